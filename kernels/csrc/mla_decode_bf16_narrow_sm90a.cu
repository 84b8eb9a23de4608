// Paged MLA decode for few query rows per request (16 heads per GPU under TP8 or V2-Lite's 16
// heads, x 1-2 query tokens), bf16 query and bf16 latent cache, Hopper (sm_90a) wgmma.
//
// Same contract as kernels/mla_decode.py::mla_decode_reference and the same outputs as the FP8
// narrow kernel (mla_decode_wgmma_narrow_sm90a.cu); the Python side is kernels/mla_decode_cuda.py,
// the design and its budget benchmarks/KERNEL_NOTES.md ("bf16 narrow kernel"). In short:
//
// - Memory-bound (B=128, 16 heads, S=4096: 604 MB against 18 GFLOP): the kernel must keep about a
//   tile of loads in flight per SM and spend few instructions per byte.
// - Tokens-major, as the FP8 narrow kernel: S^T = K . Q^T (m64nNk16 x 36: A = the cache tile, B =
//   Q, N = 16 or 32 query rows, so no MMA row is padding) and O^T += V^T . P^T (8 m-blocks of 64
//   dims x 4 k-steps of 16 tokens). bf16 wgmma reads A M-major (transposed) from shared memory, so
//   V^T is the cache tile itself: no register fragments, no byte permutes.
// - A 64-token tile is nine 8 KB TMA boxes (64 tokens x 64 dims, 128-byte swizzle); three whole
//   tiles and Q do not fit in shared memory. So the ring holds boxes, not tiles: each of the two
//   warpgroups (alternate tiles, own softmax state, merged at the end like two splits) has a
//   private ring of 12 box slots (11 with 32 rows), its tiles' boxes in consumption order. A box
//   is refilled as soon as its warpgroup is done with it (the RoPE box after Q.K^T, the others
//   after P.V), so the next tile's first boxes are in flight while a tile is consumed, and a
//   warpgroup is the only reader of its slots (one mbarrier per slot, waited in order).
// - Softmax in fp32 with exp2 and a lazily moving reference maximum (as the FP8 kernels), P in
//   bf16, stored by stmatrix.trans as P^T, the K-major B operand of P.V.
// - Slots past the sequence are loaded as they are (maybe NaN): their scores are masked, and in
//   the sequence's last tile the warpgroup zeroes those token rows of the V boxes before P.V
//   (0 x NaN is NaN inside an MMA). Split-KV writes normalized bf16 partials + fp32 LSE for the
//   combine (mla_decode_combine_sm90a.cu, PDL). The launch shape depends only on tensor shapes.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "mla_decode_common.cuh"
#include "mla_decode_wgmma_tile.cuh"
#include "sm90_async.cuh"

namespace {

constexpr int kThreads = 256;                      // two warpgroups, each on every other tile
constexpr int kWarps = 4;                          // per warpgroup
constexpr int kRowBytes = 2 * kDim;                // 1152: one token's 576 bf16 values
constexpr int kTileBoxes = kRowBytes / kBoxBytes;  // 9 boxes of 64 dims; box 8 is the RoPE part
constexpr int kVBoxes = 2 * kDimV / kBoxBytes;     // 8: the value part
constexpr int kQChunks16 = kRowBytes / 16;         // 16-byte chunks of a Q row
constexpr int kQGroup16 = kQChunks16 * 128;        // packed Q: bytes between 8-row groups
constexpr int kStageRow = 2 * kDimV + 16;          // bytes per row of the epilogue's staging
constexpr int kSmemAlign16 = 1024;
constexpr uint32_t kStep16 = 256 >> 4;             // one k16 step of packed Q: two core matrices

// Shared memory of a CTA of N query rows, from the first 1024-byte boundary.
template <int N>
struct Bf16Plan {
  static constexpr int kRing = N == 16 ? 12 : 11;                         // box slots per warpgroup
  static constexpr int kSmemRing = 0;                                     // [2 wg][kRing] boxes
  static constexpr int kSmemQ = kSmemRing + 2 * kRing * kBoxSize;         // packed Q, N x 1152
  static constexpr int kSmemP = kSmemQ + (N / 8) * kQGroup16;             // P^T per warpgroup, N x 128
  static constexpr int kSmemMax = kSmemP + 2 * N * kBoxBytes;             // float [2 wg][4 warps][N]
  static constexpr int kSmemSum = kSmemMax + 2 * kWarps * N * 4;          // float [4 warps][N]
  static constexpr int kSmemBar = kSmemSum + kWarps * N * 4;              // uint64 [2 wg][kRing]
  static constexpr int kBytes = kSmemBar + 2 * kRing * 8 + kSmemAlign16;  // + room to align the base
  static_assert(kSmemP % 1024 == 0, "P^T is 128-byte swizzled: 1024-byte aligned");
  static_assert(N * kStageRow <= kSmemP - kSmemQ, "the epilogue stages O in Q's place");
  static_assert(128 * 4 * (4 * N + N / 2) <= 2 * kRing * kBoxSize, "warpgroup 1's state fits in the ring");
  static_assert(kBytes <= 227 * 1024, "shared memory plan exceeds the SM's 227 KB");
};

// m64nNk16 for N = 16 or 32 query rows, picked by the accumulator array's size.
template <int kTransA>
__device__ __forceinline__ void wgmma_k16(float (&d)[8], uint64_t a, uint64_t b, int acc) {
  wgmma_m64n16k16_bf16<kTransA>(d, a, b, acc);
}
template <int kTransA>
__device__ __forceinline__ void wgmma_k16(float (&d)[16], uint64_t a, uint64_t b, int acc) {
  wgmma_m64n32k16_bf16<kTransA>(d, a, b, acc);
}

__device__ __forceinline__ void warpgroup_sync(int wg) { named_barrier_sync(wg + 1, 128); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// Issues the cp.async of chunk i of the CTA's N bf16 Q rows (rows from row0 of request b; rows
// past rows_total are zero) into wgmma's no-swizzle K-major layout: core matrices of 8 rows x 16
// bytes, 128 B apart along K, kQGroup16 between 8-row groups (8 consecutive chunks: one core matrix).
__device__ __forceinline__ void copy_q16_chunk(const Params& p, int b, int row0, int rows_total, uint8_t* q_s, int i) {
  const int group = i / (8 * kQChunks16), col = (i % (8 * kQChunks16)) >> 3, row = row0 + group * 8 + (i & 7);
  const bool valid = row < rows_total;
  const uint8_t* src = p.q;
  if (valid) src += b * p.q_sb + (row / p.heads) * p.q_ss + (row % p.heads) * p.q_sh + col * 16;
  cp_async_16(smem_addr(q_s + group * kQGroup16 + col * 128 + (i & 7) * 16), src, valid ? 16 : 0);
}

template <int N>
__global__ void __launch_bounds__(kThreads, 1)
    mla_decode_bf16_narrow_kernel(const Params p, const __grid_constant__ CUtensorMap kv_map) {
  using Plan = Bf16Plan<N>;
  constexpr int kRing = Plan::kRing;
  constexpr int kCols = N / 4;  // this thread's accumulator columns (query rows) 8j + 2q4 + e, c = 2j + e
  launch_dependents();          // the split combine's launch, under this kernel
  if (threadIdx.x == 0) prefetch_tensor_map(&kv_map);
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((kSmemAlign16 - (smem_addr(smem_raw) & (kSmemAlign16 - 1))) & (kSmemAlign16 - 1));
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform
  const int warp = __shfl_sync(0xffffffffu, (tid >> 5) & 3, 0), lane = tid & 31;
  const bool leader = (tid & 127) == 0;  // issues its warpgroup's box loads
  const int g = lane >> 2, q4 = lane & 3;  // accumulator fragment coordinates
  const int b = blockIdx.y, split = blockIdx.z;
  const int rows_total = p.s_q * p.heads;
  const int row0 = blockIdx.x * N;
  auto column = [&](int c) { return 8 * (c >> 1) + 2 * q4 + (c & 1); };

  uint8_t* ring = smem + Plan::kSmemRing + wg * kRing * kBoxSize;  // this warpgroup's box slots
  const uint32_t ring_addr = smem_addr(ring);
  uint8_t* q_s = smem + Plan::kSmemQ;
  const uint32_t p_addr = smem_addr(smem + Plan::kSmemP + wg * N * kBoxBytes);
  float* red_max = reinterpret_cast<float*>(smem + Plan::kSmemMax) + wg * kWarps * N;
  float* red_sum = reinterpret_cast<float*>(smem + Plan::kSmemSum);
  const uint32_t bars = smem_addr(smem + Plan::kSmemBar);
  const uint32_t bar0 = bars + wg * kRing * 8;  // slot s completes mbarrier bar0 + 8 s

  const int seq_len = p.seq_lens[b];
  const TileRange tiles(seq_len, kTile, p.num_splits, split);
  const int tile_begin = tiles.begin, n = tiles.end - tiles.begin;  // tiles of this CTA
  const int n_own = n > wg ? (n - wg + 1) / 2 : 0;  // this warpgroup's: wg, wg + 2, ...
  const int boxes = kTileBoxes * n_own;  // box m = dims 64 (m % 9).. of its tile m / 9, in slot m % kRing

  for (int c = tid; c < N * kQChunks16; c += kThreads) copy_q16_chunk(p, b, row0, rows_total, q_s, c);
  cp_async_commit();

  const int* bt_row = p.block_tables + b * p.bt_s;
  const PagedTiles paged(p.page_size);
  auto page_of = [&](int j) { return j < n_own ? bt_row[paged.entry(tile_begin + wg + 2 * j)] : 0; };
  auto load_box = [&](int m, int page) {  // the leader; `page` holds the box's tile
    const int j = m / kTileBoxes, slot = m % kRing;
    mbar_arm(bar0 + 8 * slot, kBoxSize);
    tma_load_box(ring_addr + slot * kBoxSize, &kv_map, (m - j * kTileBoxes) * kBoxBytes,
                 paged.row(tile_begin + wg + 2 * j), page, bar0 + 8 * slot);
  };

  if (tid == 0) {
    for (int t = 0; t < 2 * kRing; ++t) mbar_init(bars + 8 * t);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
  }
  __syncthreads();
  if (leader) {  // the first kRing boxes: tile 0 and the start of tile 1
    const int page0 = page_of(0), page1 = page_of(1);
    for (int m = 0; m < kRing && m < boxes; ++m) load_box(m, m < kTileBoxes ? page0 : page1);
  }
  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();  // Q

  int limit[kCols];  // causal limit (number of visible keys) of each of this thread's columns
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int row = min(row0 + column(c), rows_total - 1);
    limit[c] = seq_len - p.s_q + row / p.heads + 1;
  }

  // O^T accumulators: o[mb][4j + 2i + e] = O[query row 8j + 2q4 + e][dim 64mb + 16warp + g + 8i].
  float o[kVBoxes][N / 2];
#pragma unroll
  for (int mb = 0; mb < kVBoxes; ++mb)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) o[mb][i] = 0.f;
  float m_run[kCols], l_run[kCols];  // l_run: this thread's share of the column sums
#pragma unroll
  for (int c = 0; c < kCols; ++c) m_run[c] = -INFINITY, l_run[c] = 0.f;
  float s[N / 2];  // s[4j + 2i + e] = S[query row 8j + 2q4 + e][token 16warp + g + 8i]

  const uint32_t q_lo = desc_lo(smem_addr(q_s), 128), p_lo = desc_lo(p_addr, 16);
  for (int j = 0; j < n_own; ++j) {
    const int m0 = kTileBoxes * j;
    const int slot0 = m0 % kRing;
    auto slot_offset = [&](int box) {  // bytes from the ring's start to this tile's box
      const int slot = slot0 + box;
      return (slot >= kRing ? slot - kRing : slot) * kBoxSize;
    };
    // Refills replace this tile's boxes with boxes of the warpgroup's next two tiles; their
    // pages are read now, so the loads' latency hides under the wait.
    const bool refill = leader && m0 + kRing < boxes;
    const int page1 = refill ? page_of(j + 1) : 0, page2 = refill ? page_of(j + 2) : 0;
    auto refill_box = [&](int m) {
      if (m < boxes) load_box(m, m / kTileBoxes == j + 1 ? page1 : page2);
    };
#pragma unroll 1
    for (int box = 0; box < kTileBoxes; ++box) {
      const int m = m0 + box;
      mbar_wait_or_trap<false>(bar0 + 8 * (m % kRing), (m / kRing) & 1);
    }

    // S^T = K . Q^T: k-step ks reads 32 bytes of box ks / 4 (bytes 32 (ks % 4) of its rows).
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4 * kTileBoxes; ++ks) {
      const uint32_t a_lo = desc_lo(ring_addr + slot_offset(ks >> 2) + (ks & 3) * 32, 16);
      wgmma_k16<0>(s, make_desc(a_lo, 1024, kSwizzle128), make_desc(q_lo + ks * kStep16, kQGroup16), ks);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);

    // Mask (a tile that reaches the causal limit; slots past the sequence are always past it),
    // then column maxima: this thread's two tokens, the 8 lane groups, the 4 warps.
    const int tile_tok0 = (tile_begin + wg + 2 * j) * kTile;
    if (tile_tok0 + kTile > seq_len - p.s_q + 1) {
      const int tok = tile_tok0 + 16 * warp + g;
#pragma unroll
      for (int c = 0; c < kCols; ++c)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          if (tok + 8 * i >= limit[c]) s[4 * (c >> 1) + 2 * i + (c & 1)] = -INFINITY;
    }
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float mx = fmaxf(s[4 * (c >> 1) + (c & 1)], s[4 * (c >> 1) + 2 + (c & 1)]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      if (g == 0) red_max[warp * N + column(c)] = mx;
    }
    warpgroup_sync(wg);  // maxima; every warp's Q.K^T is done: the RoPE box is free
    if (refill) refill_box(m0 + kTileBoxes - 1 + kRing);

    // The sequence's last tile: zero the V rows of the slots past it (they may hold NaN).
    const int valid = seq_len - tile_tok0;
    if (valid < kTile) {
      const int chunks = (kTile - valid) * (kBoxBytes / 16);
#pragma unroll 1
      for (int box = 0; box < kVBoxes; ++box) {
        uint8_t* rows = ring + slot_offset(box) + valid * kBoxBytes;
        for (int i = tid & 127; i < chunks; i += 128) *reinterpret_cast<uint4*>(rows + 16 * i) = make_uint4(0, 0, 0, 0);
      }
    }

    // Lazy rescaling (the reference maximum moves only past kRescaleSlack: P <= 4), P in bf16.
    bool rescale = false;
    float alpha[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = column(c);
      float m_tile = red_max[col];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) m_tile = fmaxf(m_tile, red_max[w * N + col]);
      m_tile *= p.scale_log2;
      alpha[c] = 1.f;
      if (m_tile > m_run[c] + kRescaleSlack) {
        alpha[c] = exp2f(m_run[c] - m_tile);
        m_run[c] = m_tile;
        rescale = true;
      }
      const float bias = m_run[c] == -INFINITY ? 0.f : m_run[c];
      float& p0 = s[4 * (c >> 1) + (c & 1)];
      float& p1 = s[4 * (c >> 1) + 2 + (c & 1)];
      p0 = exp2f(fmaf(p0, p.scale_log2, -bias));
      p1 = exp2f(fmaf(p1, p.scale_log2, -bias));
      l_run[c] = l_run[c] * alpha[c] + (p0 + p1);
    }
    // P^T [query rows][64 tokens], 128-byte rows with the 128-byte swizzle, by stmatrix.trans:
    // matrix mm of 16-row block h is this warp's tokens 8 (mm & 1).. x rows 16h + 8 (mm >> 1)..
#pragma unroll
    for (int h = 0; h < N / 16; ++h) {
      uint32_t pr[4];
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) pr[mm] = pack_bf16(s[8 * h + 2 * mm], s[8 * h + 2 * mm + 1]);
      const int row = 16 * h + 8 * ((lane >> 3) >> 1) + (lane & 7), chunk = 2 * warp + ((lane >> 3) & 1);
      stmatrix_x4_trans(p_addr + row * kBoxBytes + ((chunk ^ (row & 7)) << 4), pr);
    }
    if (rescale) {
#pragma unroll
      for (int mb = 0; mb < kVBoxes; ++mb)
#pragma unroll
        for (int i = 0; i < N / 2; ++i) o[mb][i] *= alpha[2 * (i >> 2) + (i & 1)];
    }
    fence_async_shared();  // P^T and the zeroed rows are read by wgmma
    warpgroup_sync(wg);

    // O^T[512 dims, N rows] += V^T[dims, 64 tokens] . P^T[64 tokens, N rows]: box mb read M-major
    // (its token rows are the k index: 8 rows per 1024 bytes), P^T K-major.
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk)
#pragma unroll
      for (int mb = 0; mb < kVBoxes; ++mb) {
        const uint32_t a_lo = desc_lo(ring_addr + slot_offset(mb) + kk * 16 * kBoxBytes, kBoxSize);
        wgmma_k16<1>(o[mb], make_desc(a_lo, 1024, kSwizzle128), make_desc(p_lo + kk * 2, 1024, kSwizzle128), 1);
      }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < kVBoxes; ++mb) fence_regs(o[mb]);
    warpgroup_sync(wg);  // every warp's P.V is done: the V boxes and P^T are free
    if (refill) {
#pragma unroll 1
      for (int box = 0; box < kVBoxes; ++box) refill_box(m0 + box + kRing);
    }
  }

  // Warpgroup 1 hands its state to warpgroup 0 through the ring (the same thread of the other
  // warpgroup holds the same accumulator elements), which merges the two by their maxima.
  __syncthreads();  // all boxes consumed: no copy is in flight
  float* xfer = reinterpret_cast<float*>(smem + Plan::kSmemRing) + (tid & 127);  // element i at xfer[128 i]
  if (wg == 1) {
#pragma unroll
    for (int mb = 0; mb < kVBoxes; ++mb)
#pragma unroll
      for (int i = 0; i < N / 2; ++i) xfer[128 * (mb * (N / 2) + i)] = o[mb][i];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      xfer[128 * (4 * N + c)] = m_run[c];
      xfer[128 * (4 * N + kCols + c)] = l_run[c];
    }
  }
  __syncthreads();
  if (wg == 0) {
    float a0[kCols], a1[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float m1 = xfer[128 * (4 * N + c)], m = fmaxf(m_run[c], m1);
      a0[c] = m == -INFINITY ? 0.f : exp2f(m_run[c] - m);
      a1[c] = m == -INFINITY ? 0.f : exp2f(m1 - m);
      m_run[c] = m;
      l_run[c] = l_run[c] * a0[c] + xfer[128 * (4 * N + kCols + c)] * a1[c];
    }
#pragma unroll
    for (int mb = 0; mb < kVBoxes; ++mb)
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const int c = 2 * (i >> 2) + (i & 1);
        o[mb][i] = o[mb][i] * a0[c] + xfer[128 * (mb * (N / 2) + i)] * a1[c];
      }
  }

  // Column sums (warpgroup 0): the 8 lane groups, then the 4 warps.
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    float l = l_run[c];
    l += __shfl_xor_sync(0xffffffffu, l, 4);
    l += __shfl_xor_sync(0xffffffffu, l, 8);
    l += __shfl_xor_sync(0xffffffffu, l, 16);
    if (g == 0 && wg == 0) red_sum[warp * N + column(c)] = l;
  }
  __syncthreads();

  // Warpgroup 0 normalizes its O^T into a [row][dim] bf16 staging (Q's place), then all 256
  // threads write it as 16-byte runs: a split's normalized partial (unscaled) for the combine, or
  // the output (times out_scale).
  const bool split_kv = p.num_splits > 1;
  uint8_t* stage = q_s;
  if (wg == 0) {
    const float scale = split_kv ? 1.f : p.out_scale;
    float inv[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = column(c), row = row0 + col;
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) l += red_sum[w * N + col];
      inv[c] = l > 0.f ? scale / l : 0.f;
      if (warp == 0 && g == 0 && row < rows_total) {
        const float lse = l > 0.f ? (m_run[c] + log2f(l)) * kLn2 : -INFINITY;
        const long long flat = static_cast<long long>(b) * rows_total + row;
        if (split_kv)
          p.part_l[flat * p.num_splits + split] = lse;
        else
          p.lse[b * p.l_sb + (row / p.heads) * p.l_ss + (row % p.heads) * p.l_sh] = lse;
      }
    }
#pragma unroll
    for (int mb = 0; mb < kVBoxes; ++mb)
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const int c = 2 * (i >> 2) + (i & 1), dim = 64 * mb + 16 * warp + g + 8 * ((i >> 1) & 1);
        *reinterpret_cast<__nv_bfloat16*>(stage + column(c) * kStageRow + 2 * dim) = __float2bfloat16_rn(o[mb][i] * inv[c]);
      }
  }
  __syncthreads();
  constexpr int kRunsPerRow = 2 * kDimV / 16;
  for (int i = tid; i < N * kRunsPerRow; i += kThreads) {
    const int r = i / kRunsPerRow, run = i % kRunsPerRow, row = row0 + r;
    if (row >= rows_total) continue;
    const long long flat = static_cast<long long>(b) * rows_total + row;
    __nv_bfloat16* dst = split_kv ? p.part_o + (flat * p.num_splits + split) * kDimV
                                  : p.out + b * p.o_sb + (row / p.heads) * p.o_ss + (row % p.heads) * p.o_sh;
    *reinterpret_cast<uint4*>(dst + 8 * run) = *reinterpret_cast<const uint4*>(stage + r * kStageRow + 16 * run);
  }
}

template <int N>
int launch(const Params& p, long long num_pages, cudaStream_t stream) {
  auto kernel = mla_decode_bf16_narrow_kernel<N>;
  static bool configured = false;  // per instantiation
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Bf16Plan<N>::kBytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  alignas(64) CUtensorMap kv_map;
  if (!encode_cache_map(&kv_map, p, num_pages, kRowBytes)) return -2;
  const dim3 grid((p.s_q * p.heads + N - 1) / N, p.batch, p.num_splits);
  kernel<<<grid, kThreads, Bf16Plan<N>::kBytes, stream>>>(p, kv_map);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// Returns a cudaError_t (0 = success), -1 for rows_per_cta other than 16 or 32, or -2 when the
// cache's tensor map cannot be encoded. q and kv strides in Params are in bytes.
int mla_decode_bf16_narrow_sm90(const Params* p, long long num_pages, int rows_per_cta, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (rows_per_cta == 16) return launch<16>(*p, num_pages, s);
  if (rows_per_cta == 32) return launch<32>(*p, num_pages, s);
  return -1;
}

int mla_decode_bf16_narrow_sm90_smem_bytes(int rows_per_cta) {
  if (rows_per_cta == 16) return Bf16Plan<16>::kBytes;
  if (rows_per_cta == 32) return Bf16Plan<32>::kBytes;
  return -1;
}

}  // extern "C"
