// Paged MLA decode for many query rows per request (64+: 128 heads under DP attention or on one
// GPU, 16 heads x 4 MTP tokens), FP8 (e4m3) query and latent cache, Hopper (sm_90a) wgmma.
//
// Same contract as kernels/mla_decode.py::mla_decode_reference; the Python side and the launch
// choice are in kernels/mla_decode_cuda.py. Why this design (numbers in benchmarks/KERNEL_NOTES.md):
//
// - With 64+ rows decode is compute-bound (B=128, S=4096, 128 heads: 146 GFLOP against 302 MB),
//   and Hopper's only FP8 tensor-core path is wgmma: M = 64 rows per warpgroup, operands read
//   straight from shared memory. Both products run in FP8: Q.K^T and P.V.
// - A CTA = 64 query rows x a split of the request's 64-token tiles, two warpgroups that take
//   turns (FlashMLA's split of the work): warpgroup w computes the scores of tiles 2i + w
//   (S = Q.K^T, m64n64k32 x 18, both operands from shared memory) and their softmax, and
//   publishes P (e4m3, scaled by 64) in shared memory; each warpgroup accumulates its half of
//   the output dims (256w..256w+255) over every tile, its own and the other's. So one
//   warpgroup's softmax runs while the other's MMAs do, and Q is read once per tile.
// - The softmax runs as a chain over the tiles in order (0, 1, 2, ...): a tile's reference
//   maximum starts from the one the previous tile (the other warpgroup's) published. It moves
//   lazily, only when a row's maximum passes it by 4x, so the rescale factors of O are rarely
//   other than 1; a tile that moved any row stamps its slot, and O is rescaled only then.
// - FP8 wgmma needs both operands K-major, and the cache holds V token-major. So P.V runs
//   transposed, O^T += V^T . P^T (M = 64 dims, N = the 64 query rows, K = 32 tokens, 4 m-blocks
//   x 2 k-steps of m64n64k32 per warpgroup and tile, 128 fp32 accumulators per thread), with
//   V^T as the register operand: each thread loads its 8 contiguous dims of 16 tokens (8-byte
//   loads) and transposes them with byte permutes into wgmma's A fragments. P, in shared memory
//   as it is, is the K-major B operand. The reduction runs over a permutation of the tile's
//   tokens, the same for P's columns and the fragments (see p_column), chosen so that the loads
//   are free of bank conflicts.
// - Cache tiles arrive by TMA: five 128-byte x 64-token boxes per tile (the fifth half out of
//   bounds, zero-filled) into wgmma's 128-byte-swizzled K-major layout, an mbarrier per stage
//   says when they landed. Four stages; tiles of warpgroup w's parity use stages of that parity,
//   and w's first thread refills them once both warpgroups are past the tile.
// - Per warpgroup and pair of tiles: the scores of its tile issued; the V^T fragments of the
//   other warpgroup's tile before it loaded (they need only the tile); wait until that tile is
//   published, issue its P.V; softmax of its own tile under those MMAs; publish; P.V of its own
//   tile. Nothing is in flight across the loop's back edge: accumulators in flight there, or
//   wgmma groups that differ between paths, or O read while the scores are in flight, make
//   ptxas serialize every wgmma (warning C7514). Fragments built right before their wgmmas get
//   interleaved with them by ptxas, one commit group each (C7519), and a wait for one group
//   then waits for most of them: the other tile's, whose P.V runs under the softmax, are loaded
//   early.
// - Q and P use wgmma's no-swizzle layout (core matrices of 8 rows x 16 bytes, packed).
// - Slots past the sequence in a tile's last page are loaded as they are (poisoned slots hold
//   NaN): their scores are masked to -inf and the fragment loads replace them with zeros, so
//   they never reach the P.V product. Split-KV writes normalized bf16 partials + fp32 LSE for
//   the combine kernel (mla_decode_combine_sm90a.cu, launched after this one with PDL: this
//   kernel lets it launch as it starts). Launch shape depends only on tensor shapes, the tensor
//   map only on the cache tensor: capturable in a CUDA graph.

#include <cuda.h>  // CUtensorMap and its enums only: the driver is reached through the runtime
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "mla_decode_common.cuh"
#include "mla_decode_wgmma_tile.cuh"
#include "sm90_async.cuh"

namespace {

constexpr int kRows = 64;                // query rows per CTA (wgmma M)
constexpr int kThreads = 256;            // two warpgroups
// Cache tiles in shared memory; even, so that each warpgroup's tiles keep to their own stages.
constexpr int kStages = 4;
constexpr int kQBytes = 8 * kQGroupStride;
// P of one tile (64 rows x 64 tokens, e4m3): packed core matrices, 128 B along K, 512 B between
// row groups. Tile t's P, rescale factors, reference maxima and stamp live in slot t % 4: the
// other warpgroup may still read slot t while tiles t + 1 and t + 2 are published.
constexpr int kPBytes = kRows * kTile;
constexpr int kSlots = 4;

// Offsets from the first 1024-byte boundary of the dynamic shared memory.
constexpr int kSmemK = 0;
constexpr int kSmemQ = kSmemK + kStages * kTileBytes;
constexpr int kSmemP = kSmemQ + kQBytes;
constexpr int kSmemAlpha = kSmemP + kSlots * kPBytes;        // float [slot][64]: O's rescale factors
constexpr int kSmemMax = kSmemAlpha + kSlots * kRows * 4;    // float [slot][64]: reference maxima after the tile
constexpr int kSmemStamp = kSmemMax + kSlots * kRows * 4;    // int [slot]: t + 1 when tile t moved a reference
constexpr int kSmemSum = kSmemStamp + kSlots * 4;            // float [2 wg][64] sums, [2 wg][64] maxima, [64] total
constexpr int kSmemBar = kSmemSum + 5 * kRows * 4;           // uint64 [kStages]: tile landed
constexpr int kSmemAlign = 1024;
constexpr int kSmemBytes = kSmemBar + kStages * 8 + kSmemAlign;  // + room to align the base
static_assert(kSmemBytes <= 227 * 1024, "more shared memory than a Hopper CTA can have");
static_assert(kStages % 2 == 0, "each warpgroup refills the stages of its own tiles");

// Named barriers: warpgroup w published a tile (w arrives, the other syncs), and warpgroup w's
// own threads (its P and rescale factors before its P.V).
constexpr int kBarPublished = 1;  // + w
constexpr int kBarWarpgroup = 3;  // + w

constexpr int kCopies = kRows * kChunks / kThreads;  // 9 chunks per thread per 64-row operand
static_assert(kRows * kChunks % kThreads == 0, "whole copies per thread");

__global__ void __launch_bounds__(kThreads, 1)
    mla_decode_fp8_wgmma_kernel(const Params p, const __grid_constant__ CUtensorMap kv_map) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  launch_dependents();  // the split combine's launch, under this kernel
  if (threadIdx.x == 0) prefetch_tensor_map(&kv_map);
  uint8_t* smem = smem_raw + ((kSmemAlign - (smem_addr(smem_raw) & (kSmemAlign - 1))) & (kSmemAlign - 1));
  uint8_t* q_s = smem + kSmemQ;
  uint8_t* k_s = smem + kSmemK;
  uint8_t* p_s = smem + kSmemP;
  float* red_alpha = reinterpret_cast<float*>(smem + kSmemAlpha);
  float* red_max = reinterpret_cast<float*>(smem + kSmemMax);
  volatile int* stamps = reinterpret_cast<int*>(smem + kSmemStamp);
  float* red_sum = reinterpret_cast<float*>(smem + kSmemSum);
  const uint32_t bar0 = smem_addr(smem + kSmemBar);  // stage s's barrier at bar0 + 8 s

  const int tid = threadIdx.x;
  // Warpgroup: scores of tiles 2i + wg, output dims 256wg... Broadcast from lane 0 so that the
  // compiler knows them warp-uniform and keeps the descriptor math in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int warp_in_wg = __shfl_sync(0xffffffffu, (tid >> 5) & 3, 0), lane = tid & 31;
  const int g = lane >> 2, q4 = lane & 3;  // accumulator fragment coordinates
  const int b = blockIdx.y, split = blockIdx.z;
  const int rows_total = p.s_q * p.heads;
  const int row0 = blockIdx.x * kRows;

  const int seq_len = p.seq_lens[b];
  const TileRange tiles(seq_len, kTile, p.num_splits, split);
  const int tile_begin = tiles.begin, n = tiles.end - tiles.begin;  // tiles of this CTA

  // Q rows of this CTA (rows past the request are zero).
#pragma unroll
  for (int i = 0; i < kCopies; ++i) copy_q_chunk(p, b, row0, rows_total, q_s, tid + kThreads * i);
  cp_async_commit();

  const int* bt_row = p.block_tables + b * p.bt_s;
  const PagedTiles paged(p.page_size);
  auto page_of = [&](int t) { return t < n ? bt_row[paged.entry(tile_begin + t)] : 0; };
  auto load_tile = [&](int t, int page) {  // tile t of this CTA, one thread
    const int stage = t % kStages;
    const uint32_t bar = bar0 + 8 * stage, dst = smem_addr(k_s + stage * kTileBytes);
    load_tile_boxes(dst, bar, &kv_map, paged.row(tile_begin + t), page);
  };
  auto wait_tile = [&](int t) { mbar_wait(bar0 + 8 * (t % kStages), (t / kStages) & 1); };
  auto tile_smem = [&](int t) { return k_s + (t % kStages) * kTileBytes; };

  // This thread's two score rows and their causal limits (number of visible keys).
  int r_local[2], limit[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    r_local[i] = 16 * warp_in_wg + g + 8 * i;
    const int row = min(row0 + r_local[i], rows_total - 1);
    limit[i] = seq_len - p.s_q + row / p.heads + 1;
  }

  const uint32_t q_lo = desc_lo(smem_addr(q_s), 128);
  constexpr uint32_t kStepQ = 256 >> 4;  // one k-step of 32 bytes = two core matrices
  float s[32];  // S[rows 16 warp + g + 8i][tokens 8j + 2q4 + e] at s[4j + 2i + e]
  // S = Q . K^T for tile t (64 rows x 64 tokens), issued asynchronously.
  auto issue_qk = [&](int t) {
    const uint32_t k_lo = desc_lo(smem_addr(tile_smem(t)), 16);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kDim / 32; ++ks) {  // 32 bytes of K: box ks / 4, bytes 32 (ks % 4) of its rows
      const uint64_t desc_k = make_desc(k_lo + (((ks >> 2) * kBoxSize + (ks & 3) * 32) >> 4), 1024, kSwizzle128);
      wgmma_m64n64k32(s, make_desc(q_lo + ks * kStepQ, kQGroupStride), desc_k, ks);
    }
    wgmma_commit();
  };

  // O^T accumulators: o[mb][4j + 2rb + c] = O[query row 8j + 2q4 + c][dim d0 + 2mb + rb].
  const int d0 = 256 * wg + 64 * warp_in_wg + 8 * g;
  float o[4][32];
#pragma unroll
  for (int mb = 0; mb < 4; ++mb)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[mb][i] = 0.f;
  uint32_t va[2][4][4];  // V^T fragments of the tile in P.V

  // O's query rows are the accumulators' columns: a tile's rescale factors come from shared
  // memory, read only when the tile stamped its slot.
  auto rescale_o = [&](int t) {
    if (stamps[t % kSlots] != t + 1) return;
    const float* alpha = red_alpha + (t % kSlots) * kRows;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 a = *reinterpret_cast<const float2*>(alpha + 8 * j + 2 * q4);
#pragma unroll
      for (int mb = 0; mb < 4; ++mb) {
        o[mb][4 * j + 0] *= a.x;
        o[mb][4 * j + 1] *= a.y;
        o[mb][4 * j + 2] *= a.x;
        o[mb][4 * j + 3] *= a.y;
      }
    }
  };
  // O^T[this warpgroup's 256 dims, 64 rows] += V^T[dims, tile t's tokens] . P(t)^T, issued.
  auto load_va = [&](int t) { load_v_fragments(tile_smem(t), d0, q4, seq_len - (tile_begin + t) * kTile, va); };
  auto issue_pv = [&](int t) {
    const uint32_t p_lo = desc_lo(smem_addr(p_s + (t % kSlots) * kPBytes), 128);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int mb = 0; mb < 4; ++mb) wgmma_m64n64k32_rs(o[mb], va[kk][mb], make_desc(p_lo + kk * kStepQ, 512), 1);
    wgmma_commit();
  };
  auto wait_pv = [&]() {
    wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < 4; ++mb) fence_regs(o[mb]);
  };

  // The softmax state of this warpgroup's rows: the reference maximum after its last tile and
  // its share of the row sums of its own tiles' P, relative to that maximum.
  float m_own[2] = {-INFINITY, -INFINITY};
  float l_own[2] = {0.f, 0.f};
  // Softmax of tile t (this warpgroup's) from the reference maxima m_in (after tile t - 1):
  // P to slot t, rescale factors, new maxima and the stamp published.
  auto softmax = [&](int t, const float (&m_in)[2]) {
    const int tile_tok0 = (tile_begin + t) * kTile;
    if (tile_tok0 + kTile > seq_len - p.s_q + 1) {  // only a tile that reaches the causal limit
      const int tok_base = tile_tok0 + 2 * q4;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (tok_base + 8 * j + (e & 1) >= limit[e >> 1]) s[4 * j + e] = -INFINITY;
    }
    float mx[2];  // a tree, not a chain of 16 dependent maxima
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float m8[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) m8[j] = fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]);
#pragma unroll
      for (int w = 4; w > 0; w >>= 1)
#pragma unroll
        for (int j = 0; j < w; ++j) m8[j] = fmaxf(m8[j], m8[j + w]);
      mx[i] = m8[0];
    }
    const int slot = t % kSlots;
    // A row's maximum needs its 4 lanes (shuffles, which queue behind the MMAs' shared-memory
    // traffic) only when it may move the reference: while no score of the warp passes its row's
    // m_in + kRescaleSlack, every row keeps m_in, whatever its maximum.
    if (__any_sync(0xffffffffu, mx[0] * p.scale_log2 > m_in[0] + kRescaleSlack ||
                                    mx[1] * p.scale_log2 > m_in[1] + kRescaleSlack)) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      }
    }
    bool moved = false;
    float bias[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      // Scores stay unscaled: the scale is positive, so it goes on the maximum and into the
      // exponent's FMA. Lazy: the reference moves only past kRescaleSlack (log2 units), so P
      // stays below 2^kRescaleSlack, which the e4m3 scale 2^kLog2PScale leaves room for.
      const float m_tile = mx[i] * p.scale_log2;
      const float m_out = m_tile > m_in[i] + kRescaleSlack ? m_tile : m_in[i];
      const float alpha = m_out == m_in[i] ? 1.f : exp2f(m_in[i] - m_out);
      l_own[i] *= m_out == m_own[i] ? 1.f : exp2f(m_own[i] - m_out);
      m_own[i] = m_out;
      moved |= alpha != 1.f;
      // P = exp2(s * scale - m) * 2^kLog2PScale; a row with nothing visible yet keeps m at 0
      bias[i] = (m_out == -INFINITY ? 0.f : m_out) - kLog2PScale;
      if (q4 == 0) {
        red_max[slot * kRows + r_local[i]] = m_out;
        red_alpha[slot * kRows + r_local[i]] = alpha;
      }
    }
    if (moved) stamps[slot] = t + 1;

    // P -> e4m3 (B operand of O^T += V^T . P^T); row sums. This thread's 16 scores of a row
    // (tokens 8j + 2q4 + e) are P columns 16(j >> 1) + 4q4 + 2(j & 1) + e (p_column): four
    // 4-byte stores.
    uint8_t* p_tile = p_s + slot * kPBytes;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float sum = 0.f;
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        float pv[4];  // tokens 16h + 2q4 + {0, 1, 8, 9}
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          pv[k] = exp2f(fmaf(s[4 * (2 * h + (k >> 1)) + 2 * i + (k & 1)], p.scale_log2, -bias[i]));
          sum += pv[k];
        }
        const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(pv[0], pv[1]), __NV_SATFINITE, __NV_E4M3);
        const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(pv[2], pv[3]), __NV_SATFINITE, __NV_E4M3);
        const int r = r_local[i];
        *reinterpret_cast<uint32_t*>(p_tile + (r >> 3) * 512 + h * 128 + (r & 7) * 16 + 4 * q4) = lo | (hi << 16);
      }
      l_own[i] += sum;
    }
    fence_async_shared();  // P is read by wgmma (the async proxy)
  };

  int next_page = 0;  // page of the next tile this thread refills (first thread of each warpgroup)
  if (tid < kSlots) stamps[tid] = 0;  // no tile has stamped its slot yet
  if (tid == 0) {
    for (int t = 0; t < kStages; ++t) mbar_init(bar0 + 8 * t);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
  }
  __syncthreads();
  if (tid == 0)
    for (int t = 0; t < kStages && t < n; ++t) load_tile(t, page_of(t));
  const bool refiller = (tid & 127) == 0;
  if (refiller) next_page = page_of(kStages + wg);
  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();  // Q

  // Tile t is warpgroup (t % 2)'s. Each warpgroup's P.V goes in tile order: the tile before its
  // own (the other warpgroup's), then its own. The control flow per iteration is straight (the
  // first and last tiles are peeled): ptxas tracks the wgmma groups in flight only then.
  // The end of this warpgroup's tile: softmax from m_in, publish, P.V of it.
  auto finish_own = [&](int own, const float (&m_in)[2]) {
    softmax(own, m_in);
    named_barrier_arrive(kBarPublished + wg, 2 * 128);
    // Both warpgroups are past this warpgroup's previous tile (own - 2; the other one published
    // own - 1): refill its stage, off the chain of softmaxes.
    if (refiller && own >= 2 && own - 2 + kStages < n) {
      load_tile(own - 2 + kStages, next_page);
      next_page = page_of(own + kStages);
    }
    named_barrier_sync(kBarWarpgroup + wg, 128);  // this warpgroup's P and factors, for its P.V
    wait_pv();                                    // the other tile's P.V
    load_va(own);
    rescale_o(own);
    issue_pv(own);
    wait_pv();
  };
  int first = 0;
  if (wg == 0 && n > 0) {  // tile 0: nothing before it
    wait_tile(0);
    issue_qk(0);
    wgmma_wait<0>();
    fence_regs(s);
    const float m_none[2] = {-INFINITY, -INFINITY};
    finish_own(0, m_none);
    first = 1;
  }
  const int last = wg == 0 ? (n + 1) / 2 : n / 2;  // this warpgroup's tiles are 2i + wg, i < last
  for (int i = first; i < last; ++i) {
    const int own = 2 * i + wg, other = own - 1;
    wait_tile(own);
    issue_qk(own);
    wait_tile(other);  // landed long ago (the other warpgroup computed its scores)
    load_va(other);    // needs only the tile, not the other warpgroup's softmax
    named_barrier_sync(kBarPublished + (1 - wg), 2 * 128);
    float m_in[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) m_in[k] = red_max[(other % kSlots) * kRows + r_local[k]];
    if (stamps[other % kSlots] == other + 1) {  // rare: O is rescaled once the scores have landed
      wgmma_wait<0>();
      fence_regs(s);
      rescale_o(other);
    }
    issue_pv(other);
    wgmma_wait<1>();  // the scores; the other tile's P.V may still run
    fence_regs(s);
    finish_own(own, m_in);
  }
  if (n > 0 && (n - 1) % 2 != wg) {  // the last tile is the other warpgroup's
    wait_tile(n - 1);
    load_va(n - 1);
    named_barrier_sync(kBarPublished + (1 - wg), 2 * 128);
    rescale_o(n - 1);
    issue_pv(n - 1);
    wait_pv();
  }

  // Row sums of both warpgroups, each relative to its own last maximum; the reference maxima
  // only grow along the chain, so the larger one is the final one (O's).
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_own[i] += __shfl_xor_sync(0xffffffffu, l_own[i], 1);
    l_own[i] += __shfl_xor_sync(0xffffffffu, l_own[i], 2);
    if (q4 == 0) {
      red_sum[wg * kRows + r_local[i]] = l_own[i];
      red_sum[(2 + wg) * kRows + r_local[i]] = m_own[i];
    }
  }
  __syncthreads();
  float* l_total = red_sum + 4 * kRows;
  if (tid < kRows) {
    const float m0 = red_sum[2 * kRows + tid], m1 = red_sum[3 * kRows + tid], m = fmaxf(m0, m1);
    const float l0 = red_sum[tid], l1 = red_sum[kRows + tid];
    const float l = (l0 > 0.f ? l0 * exp2f(m0 - m) : 0.f) + (l1 > 0.f ? l1 * exp2f(m1 - m) : 0.f);
    l_total[tid] = l;
    const int row = row0 + tid;
    if (row < rows_total) {
      const float lse = l > 0.f ? (m + log2f(l) - kLog2PScale) * kLn2 : -INFINITY;
      if (p.num_splits > 1)
        p.part_l[(static_cast<long long>(b) * rows_total + row) * p.num_splits + split] = lse;
      else
        p.lse[b * p.l_sb + (row / p.heads) * p.l_ss + (row % p.heads) * p.l_sh] = lse;
    }
  }
  __syncthreads();

  // O: this thread's 8 dims d0..d0+7 of its 16 query rows 8j + 2q4 + c.
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int n_local = 8 * j + 2 * q4 + c, row = row0 + n_local;
      if (row >= rows_total) continue;
      const float l = l_total[n_local];
      const float inv = l > 0.f ? 1.f / l : 0.f;  // l sums the scaled P, like O
      float v[8];
#pragma unroll
      for (int ld = 0; ld < 8; ++ld) v[ld] = o[ld >> 1][4 * j + 2 * (ld & 1) + c] * inv;
      // A split's normalized partial (bf16, unscaled) for the combine, or the output.
      const bool split_kv = p.num_splits > 1;
      __nv_bfloat16* dst =
          split_kv ? p.part_o + ((static_cast<long long>(b) * rows_total + row) * p.num_splits + split) * kDimV + d0
                   : p.out + b * p.o_sb + (row / p.heads) * p.o_ss + (row % p.heads) * p.o_sh + d0;
      const float scale = split_kv ? 1.f : p.out_scale;
      uint4 packed;
      uint32_t* w = &packed.x;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * k] * scale, v[2 * k + 1] * scale);
        w[k] = *reinterpret_cast<const uint32_t*>(&pair);
      }
      *reinterpret_cast<uint4*>(dst) = packed;
    }
}

}  // namespace

extern "C" {

// Returns a cudaError_t (0 = success), or -2 when the cache's tensor map cannot be encoded.
int mla_decode_fp8_wgmma_sm90(const Params* p, long long num_pages, void* stream) {
  static bool configured = false;
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(mla_decode_fp8_wgmma_kernel,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  alignas(64) CUtensorMap kv_map;
  if (!encode_cache_map(&kv_map, *p, num_pages)) return -2;
  const dim3 grid((p->s_q * p->heads + kRows - 1) / kRows, p->batch, p->num_splits);
  mla_decode_fp8_wgmma_kernel<<<grid, kThreads, kSmemBytes, static_cast<cudaStream_t>(stream)>>>(*p, kv_map);
  return static_cast<int>(cudaGetLastError());
}

int mla_decode_fp8_wgmma_sm90_smem_bytes() { return kSmemBytes; }

// The size of Params as this library was built, checked against the ctypes mirror at load.
int mla_decode_fp8_sm90_params_bytes() { return static_cast<int>(sizeof(Params)); }

}  // extern "C"
