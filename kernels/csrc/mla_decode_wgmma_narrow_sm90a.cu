// Paged MLA decode for few query rows per request (16 heads per GPU under TP8 or V2-Lite's 16
// heads, x 1-2 query tokens), FP8 (e4m3) query and latent cache, Hopper (sm_90a) wgmma.
//
// Same contract as kernels/mla_decode.py::mla_decode_reference; the Python side and the launch
// choice are in kernels/mla_decode_cuda.py. Why this design (numbers in benchmarks/KERNEL_NOTES.md):
//
// - With 16 rows decode is memory-bound (B=128, S=4096: 18 GFLOP against 302 MB): the kernel
//   must keep HBM busy and spend few instructions per byte. The mma.sync kernel
//   (mla_decode_sm90.cu) has neither: Hopper has no FP8 mma.sync, so it widens every K and V
//   byte to f16 in registers, and its cp.async copies sit on the threads' issue path.
// - Tokens-major products put the tile's 64 tokens on wgmma's M = 64 side and the N = 16 or 32
//   query rows on its N side, so no MMA row is padding: S^T = K . Q^T (A = the cache tile from
//   shared memory, B = Q, m64nNk32 x 18), then O^T += V^T . P^T (A = V^T built in registers
//   from the tile with byte permutes, as the 64-row kernel does; B = P from shared memory;
//   8 m-blocks of 64 dims x 2 k-steps). Both products run in FP8.
// - A CTA is one request's N rows x a split of its tiles, with two warpgroups that take every
//   other tile, each with its own softmax state; at the end warpgroup 1 hands its O^T, maxima
//   and sums to warpgroup 0 through shared memory and they are merged like two splits. The
//   softmax is per accumulator column (a query row): each thread's maxima go across the 8 lane
//   groups by shuffles and across the warpgroup's 4 warps through shared memory (a named
//   barrier per warpgroup); the rescale factors then belong to the thread's own O^T columns,
//   so rescaling needs no exchange.
// - Cache tiles arrive by TMA (mla_decode_wgmma_tile.cuh) into a ring of five stages, one CTA
//   per SM: three tiles in flight while two are consumed. A warpgroup refills a tile's stage as
//   soon as its threads have the Q.K^T result and the V^T fragments, before the softmax.
//   (Measured on the H200, B=128, 16 heads: 84.7 us against 86.3 us for one warpgroup per CTA
//   and two CTAs per SM with two stages each; at B=128 it needs no split-KV, so no combine.)
// - Slots past the sequence are loaded as they are (maybe NaN): their scores are masked and
//   the fragment loads zero them. Split-KV (small batches) writes normalized bf16 partials +
//   fp32 LSE for the combine kernel (mla_decode_combine_sm90a.cu, PDL), as the 64-row kernel
//   does. The launch shape depends only on tensor shapes: capturable in a CUDA graph.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "mla_decode_common.cuh"
#include "mla_decode_wgmma_tile.cuh"
#include "sm90_async.cuh"

namespace {

constexpr int kThreads = 256;  // two warpgroups, each on every other tile
constexpr int kWarps = 4;      // per warpgroup
constexpr int kStages = 5;     // one CTA per SM: three tiles in flight while two are consumed
// Tile t waits on mbarrier t % kBars. A stage's tiles alternate between the warpgroups (kStages
// is odd), so a warpgroup can reach the wait for tile t + kStages while tile t's copy is still in
// flight: on the stage's own barrier that wait would name the phase before the pending one and
// pass at once. Two barriers per stage put tiles t and t + kStages on different barriers.
constexpr int kBars = 2 * kStages;
constexpr int kSmemAlign = 1024;
constexpr uint32_t kStep = 256 >> 4;  // one k-step of 32 bytes in a packed operand: two core matrices

// Shared memory of a CTA of N query rows, from the first 1024-byte boundary.
template <int N>
struct NarrowPlan {
  static constexpr int kSmemK = 0;                                   // kStages cache tiles
  static constexpr int kSmemQ = kSmemK + kStages * kTileBytes;       // packed Q, N x 576
  static constexpr int kSmemP = kSmemQ + (N / 8) * kQGroupStride;    // P per warpgroup, N x 64 e4m3, packed
  static constexpr int kSmemMax = kSmemP + 2 * N * kTile;            // float [2 wg][2 parities][4 warps][N]
  static constexpr int kSmemSum = kSmemMax + 2 * 2 * kWarps * N * 4; // float [4 warps][N]
  static constexpr int kSmemBar = kSmemSum + kWarps * N * 4;         // uint64 [kBars]
  static constexpr int kBytes = kSmemBar + kBars * 8 + kSmemAlign;   // + room to align the base
};

// m64nNk32 for N = 16 or 32 query rows, picked by the accumulator array's size.
__device__ __forceinline__ void wgmma_k32(float (&d)[8], uint64_t a, uint64_t b, int acc) { wgmma_m64n16k32(d, a, b, acc); }
__device__ __forceinline__ void wgmma_k32(float (&d)[16], uint64_t a, uint64_t b, int acc) { wgmma_m64n32k32(d, a, b, acc); }
__device__ __forceinline__ void wgmma_k32_rs(float (&d)[8], const uint32_t (&a)[4], uint64_t b, int acc) {
  wgmma_m64n16k32_rs(d, a, b, acc);
}
__device__ __forceinline__ void wgmma_k32_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t b, int acc) {
  wgmma_m64n32k32_rs(d, a, b, acc);
}

__device__ __forceinline__ void warpgroup_sync(int wg) { asm volatile("bar.sync %0, 128;\n" ::"r"(wg + 1) : "memory"); }

template <int N>
__global__ void __launch_bounds__(kThreads, 1)
    mla_decode_fp8_narrow_kernel(const Params p, const __grid_constant__ CUtensorMap kv_map) {
  using Plan = NarrowPlan<N>;
  launch_dependents();  // the split combine's launch, under this kernel
  if (threadIdx.x == 0) prefetch_tensor_map(&kv_map);
  // This thread's accumulator columns (query rows) are 8j + 2q4 + e; column index c = 2j + e.
  constexpr int kCols = N / 4;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((kSmemAlign - (smem_addr(smem_raw) & (kSmemAlign - 1))) & (kSmemAlign - 1));
  uint8_t* k_s = smem + Plan::kSmemK;
  uint8_t* q_s = smem + Plan::kSmemQ;
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform
  uint8_t* p_s = smem + Plan::kSmemP + wg * N * kTile;
  float* red_sum = reinterpret_cast<float*>(smem + Plan::kSmemSum);
  const uint32_t bar0 = smem_addr(smem + Plan::kSmemBar);  // tile t's barrier at bar0 + 8 (t % kBars)

  const int warp = __shfl_sync(0xffffffffu, (tid >> 5) & 3, 0), lane = tid & 31;  // warp-uniform
  const bool leader = (tid & 127) == 0;  // refills the stages its warpgroup frees
  const int g = lane >> 2, q4 = lane & 3;  // accumulator fragment coordinates
  const int b = blockIdx.y, split = blockIdx.z;
  const int rows_total = p.s_q * p.heads;
  const int row0 = blockIdx.x * N;
  auto column = [&](int c) { return 8 * (c >> 1) + 2 * q4 + (c & 1); };

  const int seq_len = p.seq_lens[b];
  const TileRange tiles(seq_len, kTile, p.num_splits, split);
  const int tile_begin = tiles.begin, n = tiles.end - tiles.begin;  // tiles of this CTA

  // Q rows of this CTA (rows past the request are zero), packed for the B operand.
  for (int c = tid; c < N * kChunks; c += kThreads) copy_q_chunk(p, b, row0, rows_total, q_s, c);
  cp_async_commit();

  const int* bt_row = p.block_tables + b * p.bt_s;
  // Thread 0 issues the first kStages tiles; then each warpgroup's leader refills the stage of the
  // tile it has just read (the page index is read at the top of that iteration).
  auto page_of = [&](int it) { return it < n ? bt_row[(tile_begin + it) * kTile / p.page_size] : 0; };
  auto load_tile = [&](int it, int page) {
    const int stage = it % kStages;
    const uint32_t bar = bar0 + 8 * (it % kBars), dst = smem_addr(k_s + stage * kTileBytes);
    load_tile_boxes(dst, bar, &kv_map, (tile_begin + it) * kTile % p.page_size, page);
  };

  if (tid == 0) {
    for (int t = 0; t < kBars; ++t) mbar_init(bar0 + 8 * t);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
  }
  __syncthreads();
  if (tid == 0 && n > 0)
    for (int t = 0; t < kStages && t < n; ++t) load_tile(t, page_of(t));
  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();  // Q

  int limit[kCols];  // causal limit (number of visible keys) of each of this thread's columns
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int row = min(row0 + column(c), rows_total - 1);
    limit[c] = seq_len - p.s_q + row / p.heads + 1;
  }

  // O^T accumulators: o[h][mb][4j + 2rb + e] = O[query row 8j + 2q4 + e][dim d0 + 256h + 2mb + rb].
  const int d0 = 64 * warp + 8 * g;
  float o[2][4][N / 2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int mb = 0; mb < 4; ++mb)
#pragma unroll
      for (int i = 0; i < N / 2; ++i) o[h][mb][i] = 0.f;
  uint32_t va[2][2][4][4];  // this tile's V^T fragments, per half of the dims
  float m_run[kCols], l_run[kCols];  // l_run: this thread's share of the column sums (scaled P)
#pragma unroll
  for (int c = 0; c < kCols; ++c) m_run[c] = -INFINITY, l_run[c] = 0.f;
  float s[N / 2];  // s[4j + 2i + e] = S[query row 8j + 2q4 + e][token 16warp + g + 8i]

  const uint32_t q_lo = desc_lo(smem_addr(q_s), 128), p_lo = desc_lo(smem_addr(p_s), 128);
  for (int it = wg; it < n; it += 2) {
    const int stage = it % kStages;
    const uint8_t* tile = k_s + stage * kTileBytes;
    const bool refill = leader && it + kStages < n;
    const int refill_page = refill ? page_of(it + kStages) : 0;  // read early: its latency hides below
    mbar_wait(bar0 + 8 * (it % kBars), (it / kBars) & 1);

    // S^T = K . Q^T: 32 bytes of K per k-step, box ks / 4, bytes 32 (ks % 4) of its rows.
    const uint32_t k_lo = desc_lo(smem_addr(tile), 16);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kDim / 32; ++ks) {
      const uint64_t desc_k = make_desc(k_lo + (((ks >> 2) * kBoxSize + (ks & 3) * 32) >> 4), 1024, kSwizzle128);
      wgmma_k32(s, desc_k, make_desc(q_lo + ks * kStep, kQGroupStride), ks);
    }
    wgmma_commit();
    const int tile_tok0 = (tile_begin + it) * kTile;
    load_v_fragments(tile, d0, q4, seq_len - tile_tok0, va[0]);  // under the MMAs
    load_v_fragments(tile, d0 + 256, q4, seq_len - tile_tok0, va[1]);
    wgmma_wait<0>();
    fence_regs(s);

    // Mask (only a tile that reaches the causal limit needs it; NaN slots past the sequence
    // are always past the limit), then column maxima: this thread's two tokens, the 8 lane
    // groups of the warp, the 4 warps. Scores stay unscaled until the exponent's FMA.
    if (tile_tok0 + kTile > seq_len - p.s_q + 1) {
      const int tok = tile_tok0 + 16 * warp + g;
#pragma unroll
      for (int c = 0; c < kCols; ++c)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          if (tok + 8 * i >= limit[c]) s[4 * (c >> 1) + 2 * i + (c & 1)] = -INFINITY;
    }
    float* red_max = reinterpret_cast<float*>(smem + Plan::kSmemMax) + (2 * wg + ((it >> 1) & 1)) * kWarps * N;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float mx = fmaxf(s[4 * (c >> 1) + (c & 1)], s[4 * (c >> 1) + 2 + (c & 1)]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      if (g == 0) red_max[warp * N + column(c)] = mx;
    }
    warpgroup_sync(wg);  // maxima; the warpgroup has this tile's scores and fragments: refill the stage
    if (refill) load_tile(it + kStages, refill_page);

    // Lazy rescaling and P in e4m3, as in the 64-row kernel (kRescaleSlack, kLog2PScale). P is
    // the B operand of O^T += V^T . P^T: row = query row, column = p_column(token).
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
      const float bias = (m_run[c] == -INFINITY ? 0.f : m_run[c]) - kLog2PScale;
      const float p0 = exp2f(fmaf(s[4 * (c >> 1) + (c & 1)], p.scale_log2, -bias));
      const float p1 = exp2f(fmaf(s[4 * (c >> 1) + 2 + (c & 1)], p.scale_log2, -bias));
      l_run[c] = l_run[c] * alpha[c] + (p0 + p1);
      const uint32_t pair = __nv_cvt_float2_to_fp8x2(make_float2(p0, p1), __NV_SATFINITE, __NV_E4M3);
      const int pc = p_column(16 * warp + g);  // token + 8 is column pc + 2
      uint8_t* dst = p_s + (col >> 3) * 512 + (pc >> 4) * 128 + (col & 7) * 16 + (pc & 15);
      dst[0] = static_cast<uint8_t>(pair);
      dst[2] = static_cast<uint8_t>(pair >> 8);
    }
    if (rescale) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int mb = 0; mb < 4; ++mb)
#pragma unroll
          for (int i = 0; i < N / 2; ++i) o[h][mb][i] *= alpha[2 * (i >> 2) + (i & 1)];
    }
    fence_async_shared();
    warpgroup_sync(wg);  // P complete

    // O^T[512 dims, N rows] += V^T[dims, 64 tokens] . P^T[64 tokens, N rows].
    wgmma_fence();
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
#pragma unroll
        for (int mb = 0; mb < 4; ++mb) wgmma_k32_rs(o[h][mb], va[h][kk][mb], make_desc(p_lo + kk * kStep, 512), 1);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int mb = 0; mb < 4; ++mb) fence_regs(o[h][mb]);
  }

  // Warpgroup 1 hands its state to warpgroup 0 through the idle stages (the same thread of the
  // other warpgroup holds the same accumulator elements), which merges the two by their maxima.
  __syncthreads();  // all tiles consumed
  float* xfer = reinterpret_cast<float*>(k_s) + (tid & 127);  // element i at xfer[128 i]
  if (wg == 1) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int mb = 0; mb < 4; ++mb)
#pragma unroll
        for (int i = 0; i < N / 2; ++i) xfer[128 * ((h * 4 + mb) * (N / 2) + i)] = o[h][mb][i];
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
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int mb = 0; mb < 4; ++mb)
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
          const int c = 2 * (i >> 2) + (i & 1);
          o[h][mb][i] = o[h][mb][i] * a0[c] + xfer[128 * ((h * 4 + mb) * (N / 2) + i)] * a1[c];
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
  if (wg != 0) return;

#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int col = column(c), row = row0 + col;
    if (row >= rows_total) continue;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) l += red_sum[w * N + col];
    const float inv = l > 0.f ? 1.f / l : 0.f;  // l sums the scaled P, like O
    const long long flat = static_cast<long long>(b) * rows_total + row;
    if (warp == 0 && g == 0) {
      const float lse = l > 0.f ? (m_run[c] + log2f(l) - kLog2PScale) * kLn2 : -INFINITY;
      if (p.num_splits > 1)
        p.part_l[flat * p.num_splits + split] = lse;
      else
        p.lse[b * p.l_sb + (row / p.heads) * p.l_ss + (row % p.heads) * p.l_sh] = lse;
    }
    // This thread's 8 dims d0 + 256h .. +7 of the row.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v[8];
#pragma unroll
      for (int ld = 0; ld < 8; ++ld) v[ld] = o[h][ld >> 1][4 * (c >> 1) + 2 * (ld & 1) + (c & 1)] * inv;
      const int dim = d0 + 256 * h;
      // A split's normalized partial (bf16, unscaled) for the combine, or the output.
      const bool split_kv = p.num_splits > 1;
      __nv_bfloat16* dst = split_kv ? p.part_o + (flat * p.num_splits + split) * kDimV + dim
                                    : p.out + b * p.o_sb + (row / p.heads) * p.o_ss + (row % p.heads) * p.o_sh + dim;
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
}

template <int N>
int launch(const Params& p, long long num_pages, cudaStream_t stream) {
  auto kernel = mla_decode_fp8_narrow_kernel<N>;
  static bool configured = false;  // per instantiation
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, NarrowPlan<N>::kBytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  alignas(64) CUtensorMap kv_map;
  if (!encode_cache_map(&kv_map, p, num_pages)) return -2;
  const dim3 grid((p.s_q * p.heads + N - 1) / N, p.batch, p.num_splits);
  kernel<<<grid, kThreads, NarrowPlan<N>::kBytes, stream>>>(p, kv_map);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// Returns a cudaError_t (0 = success), -1 for rows_per_cta other than 16 or 32, or -2 when the
// cache's tensor map cannot be encoded.
int mla_decode_fp8_wgmma_narrow_sm90(const Params* p, long long num_pages, int rows_per_cta, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (rows_per_cta == 16) return launch<16>(*p, num_pages, s);
  if (rows_per_cta == 32) return launch<32>(*p, num_pages, s);
  return -1;
}

int mla_decode_fp8_wgmma_narrow_sm90_smem_bytes(int rows_per_cta) {
  if (rows_per_cta == 16) return NarrowPlan<16>::kBytes;
  if (rows_per_cta == 32) return NarrowPlan<32>::kBytes;
  return -1;
}

}  // extern "C"
