// Paged MLA decode for many query rows per request (64+: 128 heads under DP attention or on one
// GPU, 16 heads x 4 MTP tokens), FP8 (e4m3) query and latent cache, Hopper (sm_90a) wgmma.
//
// Same contract as kernels/mla_decode.py::mla_decode_reference; the Python side and the launch
// choice are in kernels/mla_decode_cuda.py. Why this design (numbers in benchmarks/KERNEL_NOTES.md):
//
// - With 64+ rows decode is compute-bound (B=128, S=4096, 128 heads: 146 GFLOP against 302 MB),
//   and Hopper's only FP8 tensor-core path is wgmma: M = 64 rows per warpgroup, operands read
//   straight from shared memory once per 64 rows (mma.sync re-reads them per 16-row warp: the
//   sister kernel's limit at 128 heads). Both products run in FP8: Q.K^T and P.V.
// - A CTA = 64 query rows x a split of the request's 64-token tiles, two warpgroups. For each
//   tile, warpgroup w computes scores for tokens 32w..32w+31 (m64n32k32, no duplicated Q.K^T;
//   the first 8 of 18 k-steps take Q from registers, the rest from shared memory), the row
//   maxima are exchanged through shared memory, each warpgroup writes its P (e4m3, scaled by
//   64) and accumulates O for output dims 256w..256w+255 over the whole tile. The running
//   maximum moves lazily (only when a row's maximum passes it by 4x), so O is rarely rescaled.
// - FP8 wgmma needs both operands K-major, and the cache holds V token-major. So P.V runs
//   transposed, O^T += V^T . P^T (M = 64 dims, N = the 64 query rows, K = 32 tokens, 4 m-blocks
//   x 2 k-steps of m64n64k32 per warpgroup, 128 fp32 accumulators per thread), with V^T as the
//   register operand: each thread loads its 8 contiguous dims of 16 tokens (8-byte loads) and
//   transposes them with byte permutes into wgmma's A fragments. P, in shared memory as it is,
//   is the K-major B operand. The reduction runs over a permutation of the tile's tokens, the
//   same for P's columns and the fragments (see p_column), chosen so that the loads are free
//   of bank conflicts. (Earlier versions transposed V into a shared-memory V^T: 64 KB more
//   shared-memory traffic per tile; a producer warpgroup doing those transposes was slower
//   still. Numbers in benchmarks/KERNEL_NOTES.md.)
// - Cache tiles arrive by TMA: one thread issues five 128-byte x 64-token boxes per tile (the
//   fifth half out of bounds, zero-filled) into wgmma's 128-byte-swizzled K-major layout, and
//   an mbarrier per stage says when they landed. (Per-thread cp.async of 16-byte chunks cost
//   40 % of the kernel's time: 2304 copies per tile, their address math on the issue path.)
// - Software pipeline: the softmax of a tile runs under Q.K^T of the next one, up to three
//   more tiles are in flight, and a tile's page index is read an iteration before its TMA.
// - Q and P use wgmma's no-swizzle layout (core matrices of 8 rows x 16 bytes, packed).
// - Slots past the sequence in a tile's last page are loaded as they are (poisoned slots hold
//   NaN): their scores are masked to -inf and the fragment loads replace them with zeros, so
//   they never reach the P.V product. Split-KV writes normalized partials + LSE for the combine
//   kernel (kernels/mla_decode_triton.py), like the sister kernel. Launch shape depends only on
//   tensor shapes, the tensor map only on the cache tensor: capturable in a CUDA graph.

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
// Cache tiles in shared memory. A tile's stage is refilled only once its P.V fragments are
// loaded (after the P hand-off), so four stages keep two loads ahead of Q.K^T.
constexpr int kStages = 4;
constexpr int kQBytes = 8 * kQGroupStride;
// P (64 rows x 64 tokens, e4m3): packed core matrices, 128 B along K, 512 B between row groups.
constexpr int kPBytes = kRows * kTile;

// Offsets from the first 1024-byte boundary of the dynamic shared memory.
constexpr int kSmemK = 0;
constexpr int kSmemQ = kSmemK + kStages * kTileBytes;
constexpr int kSmemP = kSmemQ + kQBytes;
constexpr int kSmemMax = kSmemP + kPBytes;                  // float [2 parities][2 wg][64]
constexpr int kSmemSum = kSmemMax + 2 * 2 * kRows * 4;       // float [2 wg][64]
constexpr int kSmemAlpha = kSmemSum + 2 * kRows * 4;         // float [64]: this tile's rescale
constexpr int kSmemBar = kSmemAlpha + kRows * 4;             // uint64 [kStages]: tile landed
constexpr int kSmemAlign = 1024;
constexpr int kSmemBytes = kSmemBar + kStages * 8 + kSmemAlign;  // + room to align the base
static_assert(kSmemBytes <= 227 * 1024, "more shared memory than a Hopper CTA can have");

constexpr int kCopies = kRows * kChunks / kThreads;  // 9 chunks per thread per 64-row operand
static_assert(kRows * kChunks % kThreads == 0, "whole copies per thread");

__global__ void __launch_bounds__(kThreads, 1)
    mla_decode_fp8_wgmma_kernel(const Params p, const __grid_constant__ CUtensorMap kv_map) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((kSmemAlign - (smem_addr(smem_raw) & (kSmemAlign - 1))) & (kSmemAlign - 1));
  uint8_t* q_s = smem + kSmemQ;
  uint8_t* k_s = smem + kSmemK;
  float* red_sum = reinterpret_cast<float*>(smem + kSmemSum);
  const uint32_t bar0 = smem_addr(smem + kSmemBar);  // stage s's barrier at bar0 + 8 s

  const int tid = threadIdx.x;
  // Warpgroup: scores for tokens 32wg.. of each tile, output dims 256wg... Broadcast from lane 0
  // so that the compiler knows them warp-uniform and keeps the descriptor math that depends on
  // them in uniform registers (per-thread values cost a register move per wgmma operand).
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int warp_in_wg = __shfl_sync(0xffffffffu, (tid >> 5) & 3, 0), lane = tid & 31;
  const int g = lane >> 2, q4 = lane & 3;  // accumulator fragment coordinates
  const int b = blockIdx.y, split = blockIdx.z;
  const int rows_total = p.s_q * p.heads;
  const int row0 = blockIdx.x * kRows;

  const int seq_len = p.seq_lens[b];
  const TileRange tiles(seq_len, kTile, p.num_splits, split);
  const int tile_begin = tiles.begin, n = tiles.end - tiles.begin;  // tiles of this CTA

  // Q rows of this CTA (rows past the request are zero), in the first copy group.
#pragma unroll
  for (int i = 0; i < kCopies; ++i) {
    const int c = tid + kThreads * i;
    const int row = row0 + chunk_row(c);
    const bool valid = row < rows_total;
    const uint8_t* src = p.q;
    if (valid) src += b * p.q_sb + (row / p.heads) * p.q_ss + (row % p.heads) * p.q_sh + chunk_col(c) * 16;
    cp_async_16(smem_addr(q_s + chunk_dst(c)), src, valid ? 16 : 0);
  }

  const int* bt_row = p.block_tables + b * p.bt_s;
  // Thread 0 loads the tiles. The page of tile `it` is read from the block table an iteration
  // before its TMA is issued (a dependent global load right before the issue would stall).
  auto page_of = [&](int it) { return it < n ? bt_row[(tile_begin + it) * kTile / p.page_size] : 0; };
  auto load_tile = [&](int it, int page) {  // tile `it` of this CTA, thread 0 only
    const int stage = it % kStages;
    const uint32_t bar = bar0 + 8 * stage, dst = smem_addr(k_s + stage * kTileBytes);
    const int row = (tile_begin + it) * kTile % p.page_size;
    mbar_arm(bar, kTileBytes);
#pragma unroll
    for (int i = 0; i < kBoxes; ++i) tma_load_box(dst + i * kBoxSize, &kv_map, i * kBoxBytes, row, page, bar);
  };
  auto wait_tile = [&](int it) { mbar_wait(bar0 + 8 * (it % kStages), (it / kStages) & 1); };
  auto valid_in = [&](int it) { return seq_len - (tile_begin + it) * kTile; };  // tokens of tile it

  const uint32_t q_lo = desc_lo(smem_addr(q_s), 128);
  // Q.K^T with N = 32 reads 2 KB of Q per 1 KB of K from shared memory: the first kQRegSteps
  // k-steps take Q from registers instead (measured: 8 -> 2 % faster; 12 spill).
  constexpr int kQRegSteps = 8;
  uint32_t q_reg[kQRegSteps][4];
  constexpr uint32_t kStepQ = 256 >> 4;            // one k-step of 32 bytes = two core matrices
  uint8_t* p_s = smem + kSmemP;
  // S = Q . K^T for this warpgroup's 32 tokens of tile `it`, issued asynchronously.
  auto issue_qk = [&](float (&s)[16], int it) {
    const uint32_t k_lo = desc_lo(smem_addr(k_s + (it % kStages) * kTileBytes + 32 * wg * kBoxBytes), 16);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kDim / 32; ++ks) {  // 32 bytes of K: box ks / 4, bytes 32 (ks % 4) of its rows
      const uint64_t desc_k = make_desc(k_lo + (((ks >> 2) * kBoxSize + (ks & 3) * 32) >> 4), 1024, kSwizzle128);
      if (ks < kQRegSteps) wgmma_m64n32k32_rs(s, q_reg[ks], desc_k, ks);
      if (ks >= kQRegSteps) wgmma_m64n32k32(s, make_desc(q_lo + ks * kStepQ, kQGroupStride), desc_k, ks);
    }
    wgmma_commit();
  };

  // This thread's two accumulator rows and their causal limits (number of visible keys).
  int r_local[2], limit[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    r_local[i] = 16 * warp_in_wg + g + 8 * i;
    const int row = min(row0 + r_local[i], rows_total - 1);
    limit[i] = seq_len - p.s_q + row / p.heads + 1;
  }

  // O^T accumulators: o[mb][4j + 2rb + c] = O[query row 8j + 2q4 + c][dim d0 + 2mb + rb].
  const int d0 = 256 * wg + 64 * warp_in_wg + 8 * g;
  float o[4][32];
#pragma unroll
  for (int mb = 0; mb < 4; ++mb)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[mb][i] = 0.f;
  uint32_t va[2][4][4];  // this tile's V^T fragments
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};  // this thread's share of the row sums (of the scaled P)
  float s[16], s_next[16];

  // Software pipeline: the softmax of tile `it` runs under Q.K^T of tile it+1; tiles it+2 to
  // it+4 are in flight meanwhile (measured: the copies, not the MMAs, bound this kernel when
  // only one tile was in flight). Both products are waited for at the end of each iteration:
  // accumulators still in flight across the loop's back edge make ptxas serialize every wgmma
  // (warning C7514).
  cp_async_commit();  // Q
  int next_page = 0;  // page of tile it+kStages (thread 0)
  if (tid == 0) {
    for (int t = 0; t < kStages; ++t) mbar_init(bar0 + 8 * t);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
  }
  __syncthreads();
  if (tid == 0 && n > 0) {
    for (int t = 0; t < kStages && t < n; ++t) load_tile(t, page_of(t));
    next_page = page_of(kStages);
  }
  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();  // Q
  // The first k-steps of Q as register fragments (fewer shared-memory bytes per Q.K^T).
#pragma unroll
  for (int ks = 0; ks < kQRegSteps; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = 16 * warp_in_wg + g + 8 * (r & 1), chunk = 2 * ks + (r >> 1);
      q_reg[ks][r] = *reinterpret_cast<const uint32_t*>(q_s + (row >> 3) * kQGroupStride + chunk * 128 + (row & 7) * 16 + 4 * q4);
    }
  if (n > 0) {
    wait_tile(0);
    issue_qk(s, 0);
    wgmma_wait<0>();
    fence_regs(s);
  }

  // Unrolled by two so that handing s_next over to s is a register renaming, not 16 moves.
#pragma unroll 2
  for (int it = 0; it < n; ++it) {
    const bool has_next = it + 1 < n;
    if (has_next) {
      wait_tile(it + 1);
      issue_qk(s_next, it + 1);
    }
    load_v_fragments(k_s + (it % kStages) * kTileBytes, d0, q4, valid_in(it), va);

    // Mask (only a tile that reaches the causal limit needs it), row maxima across both
    // warpgroups. Scores stay unscaled: the scale is positive, so it is applied to the maxima
    // and folded into the exponent's FMA.
    const int tile_tok0 = (tile_begin + it) * kTile;
    if (tile_tok0 + kTile > seq_len - p.s_q + 1) {
      const int tok_base = tile_tok0 + 32 * wg + 2 * q4;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (tok_base + 8 * j + (e & 1) >= limit[e >> 1]) s[4 * j + e] = -INFINITY;
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * j + e]);
    float* red_max = reinterpret_cast<float*>(smem + kSmemMax) + (it & 1) * 2 * kRows;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      if (q4 == 0) red_max[wg * kRows + r_local[i]] = mx[i];
    }
    __syncthreads();
    // Lazy rescaling: the reference maximum m_run moves only when a row's maximum passes it by
    // more than kRescaleSlack (log2 units), so O is rescaled on few tiles; P then stays below
    // 2^kRescaleSlack, which the e4m3 scale 2^kLog2PScale leaves room for.
    float alpha[2], bias[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_tile = fmaxf(red_max[r_local[i]], red_max[kRows + r_local[i]]) * p.scale_log2;
      alpha[i] = 1.f;
      if (m_tile > m_run[i] + kRescaleSlack) {
        alpha[i] = exp2f(m_run[i] - m_tile);
        m_run[i] = m_tile;
      }
      // P = exp2(s * scale - m) * 2^kLog2PScale; a row with nothing visible yet keeps m at 0
      bias[i] = (m_run[i] == -INFINITY ? 0.f : m_run[i]) - kLog2PScale;
    }

    // P -> e4m3 in shared memory (B operand of O^T += V^T . P^T); row sums. This thread's 8
    // scores of a row (tokens 32wg + 8j + 2q4 + e) are P columns 32wg + 16(j >> 1) + 4q4 +
    // 2(j & 1) + e (p_column): two 4-byte stores.
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float pv[4][2];  // [j][e]
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          pv[j][e] = exp2f(fmaf(s[4 * j + 2 * i + e], p.scale_log2, -bias[i]));
          sum[i] += pv[j][e];
        }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(pv[2 * hh][0], pv[2 * hh][1]), __NV_SATFINITE, __NV_E4M3);
        const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(pv[2 * hh + 1][0], pv[2 * hh + 1][1]), __NV_SATFINITE, __NV_E4M3);
        const int r = r_local[i], col = p_column(32 * wg + 16 * hh + 2 * q4);
        *reinterpret_cast<uint32_t*>(p_s + (r >> 3) * 512 + (col >> 4) * 128 + (r & 7) * 16 + (col & 15)) = lo | (hi << 16);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) l_run[i] = l_run[i] * alpha[i] + sum[i];

    // O's query rows are the accumulators' columns, spread over other threads: the rescale
    // factors go through shared memory (both warpgroups computed the same ones).
    float* red_alpha = reinterpret_cast<float*>(smem + kSmemAlpha);
    if (wg == 0 && q4 == 0) {
      red_alpha[r_local[0]] = alpha[0];
      red_alpha[r_local[1]] = alpha[1];
    }
    fence_async_shared();
    // P of tile `it` from both warpgroups; every thread is done with tile it's stage.
    const bool rescale = __syncthreads_or(alpha[0] != 1.f || alpha[1] != 1.f);
    if (tid == 0 && it + kStages < n) {
      load_tile(it + kStages, next_page);
      next_page = page_of(it + kStages + 1);
    }
    if (rescale) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 a = *reinterpret_cast<const float2*>(red_alpha + 8 * j + 2 * q4);
#pragma unroll
        for (int mb = 0; mb < 4; ++mb) {
          o[mb][4 * j + 0] *= a.x;
          o[mb][4 * j + 1] *= a.y;
          o[mb][4 * j + 2] *= a.x;
          o[mb][4 * j + 3] *= a.y;
        }
      }
    }

    // O^T[this warpgroup's 256 dims, 64 rows] += V^T[dims, 64 tokens] . P^T[64 tokens, 64 rows].
    {
      const uint32_t p_lo = desc_lo(smem_addr(p_s), 128);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
#pragma unroll
        for (int mb = 0; mb < 4; ++mb) wgmma_m64n64k32_rs(o[mb], va[kk][mb], make_desc(p_lo + kk * kStepQ, 512), 1);
      wgmma_commit();
    }
    wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < 4; ++mb) fence_regs(o[mb]);
    fence_regs(s_next);
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = s_next[i];
  }
  wgmma_wait<0>();

  // Row sums: the 4 lanes of a row, then both warpgroups.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
    if (q4 == 0) red_sum[wg * kRows + r_local[i]] = l_run[i];
  }
  __syncthreads();

  // LSE, by the threads that own the rows' statistics.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + r_local[i];
    if (wg != 0 || q4 != 0 || row >= rows_total) continue;
    const float l = red_sum[r_local[i]] + red_sum[kRows + r_local[i]];
    const float lse = l > 0.f ? (m_run[i] + log2f(l) - kLog2PScale) * kLn2 : -INFINITY;
    if (p.num_splits > 1)
      p.part_l[(static_cast<long long>(b) * rows_total + row) * p.num_splits + split] = lse;
    else
      p.lse[b * p.l_sb + (row / p.heads) * p.l_ss + (row % p.heads) * p.l_sh] = lse;
  }
  // O: this thread's 8 dims d0..d0+7 of its 16 query rows 8j + 2q4 + c.
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int n_local = 8 * j + 2 * q4 + c, row = row0 + n_local;
      if (row >= rows_total) continue;
      const float l = red_sum[n_local] + red_sum[kRows + n_local];
      const float inv = l > 0.f ? 1.f / l : 0.f;  // l sums the scaled P, like O
      float v[8];
#pragma unroll
      for (int ld = 0; ld < 8; ++ld) v[ld] = o[ld >> 1][4 * j + 2 * (ld & 1) + c] * inv;
      if (p.num_splits > 1) {
        float* dst = p.part_o + ((static_cast<long long>(b) * rows_total + row) * p.num_splits + split) * kDimV + d0;
        *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(v[4], v[5], v[6], v[7]);
      } else {
        __nv_bfloat16* dst = p.out + b * p.o_sb + (row / p.heads) * p.o_ss + (row % p.heads) * p.o_sh + d0;
        uint4 packed;
        uint32_t* w = &packed.x;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * k] * p.out_scale, v[2 * k + 1] * p.out_scale);
          w[k] = *reinterpret_cast<const uint32_t*>(&pair);
        }
        *reinterpret_cast<uint4*>(dst) = packed;
      }
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

}  // extern "C"
