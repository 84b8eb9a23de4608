// MXFP8 GEMM for Hopper (sm_90a): C = (A8 . 2^SA)(B8 . 2^SB)^T with the scales applied per
// 32-wide K slice. Same contract as kernels/mxfp8_gemm.py::mxfp8_gemm_reference; the Python side
// and the launch choice are in kernels/mxfp8_gemm_cuda.py. Why this design (numbers in
// benchmarks/KERNEL_NOTES.md, "MXFP8 GEMM in CUDA C++"):
//
// - Hopper has no block-scaled MMA, and the MX scales change every 32 of K, which is one FP8
//   wgmma (m64n128k32). So each slice's product lands in its own fp32 partial and is added to the
//   accumulator as acc += P . 2^(ea+eb) (an FMA per output per 32 MACs, ~50 % of the fp32 pipe at
//   ~1000 TFLOP/s). That FMA must run while the tensor cores work on the next slice: two partial
//   register sets per thread, the wgmma of slice j+1 issued before slice j is promoted
//   (wgmma.wait_group 1 then waits only for slice j).
// - Persistent CTAs (one per SM), each walking work units = output tile x split of K: a 64-row
//   (one consumer warpgroup) or 128-row (two) x 128-column tile. One thread of a producer
//   warpgroup issues the TMA loads (128 K bytes of A's rows and of B's rows per stage, 128-byte
//   swizzle, wgmma's K-major layout) into a ring of stages and runs ahead across work units, so
//   the next tile's loads overlap this one's epilogue; an mbarrier pair per stage (full: the
//   bytes landed; empty: every consumer warp is done with it).
// - The stage's scales travel with it: the producer warp's lanes copy the rows' 4 scale bytes
//   (one word per row, cp.async with a zero fill past M, completing on the stage's full
//   barrier) and the 4 column blocks' words into shared memory. Activation scale rows ([M, K/32]
//   bytes) are too short for a TMA box. Shapes whose scale rows are not 4-byte aligned (K not a
//   multiple of 128) take a synchronous byte-copy path.
// - Registers per consumer thread: 64 accumulators + 2 x 64 partials (with 128-row tiles,
//   setmaxnreg moves the producer warpgroup's registers to the consumers).
// - Nothing is in flight across the loop's back edge (ptxas serializes every wgmma otherwise):
//   a stage's four slices run issue 0, issue 1, wait 1, promote 0, issue 2, wait 1, promote 1,
//   issue 3, wait 1, promote 2, wait 0, promote 3; the un-overlapped last promotion of one
//   warpgroup runs under the other's MMAs.
// - Epilogues from the registers: bf16 (round to nearest even), fp32, fp32 split-K partials
//   (summed in order by a second kernel), or MXFP8 (bf16 rounding, amax over each 32 columns
//   across the four lanes that hold them, UE8M0 byte, e4m3 round-to-nearest-even on the integer
//   bits): the same integer rules as kernels/mxfp8_quant_triton.py, so the bytes are those of
//   quantizing the bf16 output separately.
// - K past the end (a last stage shorter than 128; single-group GEMMs only) is zero-filled by
//   the TMA and its scales are 0. Launch shape from tensor shapes only; the tensor maps are
//   kernel parameters (encoded on the host per call):
//   capturable in a CUDA graph.

#include "mxfp8_gemm_common.cuh"

namespace {

constexpr int kRingBytes = 192 * 1024;  // the stages' tiles

template <int kConsumers>
struct Plan : TileGeometry<kConsumers> {
  using G = TileGeometry<kConsumers>;
  static constexpr int kStages = kRingBytes / G::kStageBytes;  // 6 (128 rows) or 8 (64 rows)
  static constexpr int kSmemBytes = kStages * (G::kStageBytes + 4 * G::kScaleWords + 16) + 1024;  // + barriers, alignment
};

// acc += P . 2^(ea + eb): slice `j` of this thread's scale words; the thread's rows r0, r0 + 8
// (sa[0], sa[1]) and the tile's four 32-column blocks (sb[0..3]); accumulator 4i + 2r + e is
// row r0 + 8r, column 8i + 2 (lane % 4) + e, in block i / 4.
__device__ __forceinline__ void promote(float (&acc)[64], const float (&part)[64], const uint32_t (&sa)[2],
                                        const uint32_t (&sb)[4], int j) {
  float fa[2], s[2][4];
#pragma unroll
  for (int r = 0; r < 2; ++r) fa[r] = pow2_from_byte((sa[r] >> (8 * j)) & 0xFFu);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float fb = pow2_from_byte((sb[c] >> (8 * j)) & 0xFFu);
    s[0][c] = fa[0] * fb;
    s[1][c] = fa[1] * fb;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int v = 0; v < 4; ++v) acc[4 * i + v] = fmaf(part[4 * i + v], s[v >> 1][i >> 2], acc[4 * i + v]);
}

// Work unit u: output tile (grouped along M for L2 reuse of B) and split of K.
struct WorkUnit {
  int m0, n0, split;
  template <int kBlockM>
  __device__ static WorkUnit make(int u, int tiles_m, int tiles_n) {
    const int tiles = tiles_m * tiles_n, tile = u % tiles, width = kGroupM * tiles_n;
    const int first_m = (tile / width) * kGroupM, size_m = min(tiles_m - first_m, kGroupM);
    return {(first_m + (tile % width) % size_m) * kBlockM, ((tile % width) / size_m) * kBlockN, u / tiles};
  }
};

template <int kConsumers, bool kAlignedScales>
__global__ void __launch_bounds__(Plan<kConsumers>::kThreads, 1)
    mxfp8_gemm_kernel(const GemmParams p, const __grid_constant__ CUtensorMap map_a,
                      const __grid_constant__ CUtensorMap map_b) {
  using P = Plan<kConsumers>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t ring = smem_u32(smem);
  uint32_t* scale_s = reinterpret_cast<uint32_t*>(smem + P::kStages * P::kStageBytes);  // [stage][kScaleWords]
  const uint32_t full0 = smem_u32(scale_s + P::kStages * P::kScaleWords), empty0 = full0 + 8 * P::kStages;

  const int tiles_m = (p.m + P::kBlockM - 1) / P::kBlockM, tiles_n = (p.n + kBlockN - 1) / kBlockN;
  const int units = tiles_m * tiles_n * p.splits;
  const int k_stages = (p.k_group + kBlockK - 1) / kBlockK;
  const int nb_total = (p.n + 31) / 32;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < P::kStages; ++s) {
      mbar_init_count(full0 + 8 * s, 1 + 32);  // the TMA's arming thread + the scale-copying lanes
      mbar_init_count(empty0 + 8 * s, 4 * kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
  }
  __syncthreads();

  if (warp >= 4 * kConsumers) {  // producer warpgroup: its first warp loads, the others idle
    // 128-row tiles (three warpgroups) need more registers than an even split gives (168):
    // the producer gives most of its own to the consumers.
    if (kConsumers == 2) setmaxnreg_dec<40>();
    if (warp != 4 * kConsumers) return;
    int g = 0;  // stages loaded so far (ring position and phase)
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const WorkUnit w = WorkUnit::template make<P::kBlockM>(u, tiles_m, tiles_n);
      const int ka0 = (w.n0 / p.n_group) * p.k_group;  // this tile's group's first K column of A
      const int it0 = w.split * p.k_iters_per_split, it1 = min(k_stages, it0 + p.k_iters_per_split);
      for (int it = it0; it < it1; ++it, ++g) {
        const int s = g % P::kStages, round = g / P::kStages;
        if (round > 0) mbar_wait(empty0 + 8 * s, (round - 1) & 1);
        const uint32_t bar = full0 + 8 * s;
        uint32_t* words = scale_s + s * P::kScaleWords;
        const int kb = it * (kBlockK / 32);  // the stage's first slice
        copy_stage_scales<P::kBlockM, kAlignedScales>(p, words, w.m0, w.n0, ka0, kb, nb_total, lane);
        if (lane == 0) {
          mbar_arm(bar, P::kStageBytes);
          const uint32_t a_dst = ring + s * P::kStageBytes;
          tma_load_2d(a_dst, &map_a, ka0 + it * kBlockK, w.m0, bar);
          tma_load_2d(a_dst + P::kABytes, &map_b, it * kBlockK, w.n0, bar);
        }
        if (kAlignedScales) cp_async_arrive(bar);  // when this lane's copies land
        else mbar_arrive(bar);                     // its plain stores are ordered by the release
      }
    }
    return;
  }

  // consumer warpgroup wg: rows m0 + 64 wg .. +63 of each tile
  if (kConsumers == 2) setmaxnreg_inc<232>();
  const int wg = warp / 4, t = threadIdx.x % 128;
  const int row_local = wg * kRowsPerConsumer + 16 * (t / 32) + (t % 32) / 4;  // and + 8
  float part0[64], part1[64];
  int g = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const WorkUnit w = WorkUnit::template make<P::kBlockM>(u, tiles_m, tiles_n);
    const int it0 = w.split * p.k_iters_per_split, it1 = min(k_stages, it0 + p.k_iters_per_split);
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    for (int it = it0; it < it1; ++it, ++g) {
      const int s = g % P::kStages, round = g / P::kStages;
      mbar_wait(full0 + 8 * s, round & 1);
      const uint32_t* words = scale_s + s * P::kScaleWords;
      const uint32_t sa[2] = {words[row_local], words[row_local + 8]};
      const uint4 sb4 = *reinterpret_cast<const uint4*>(words + P::kBlockM);
      const uint32_t sb[4] = {sb4.x, sb4.y, sb4.z, sb4.w};
      const uint32_t a_lo = desc_lo(ring + s * P::kStageBytes + wg * kRowsPerConsumer * kBlockK, 16);
      const uint32_t b_lo = desc_lo(ring + s * P::kStageBytes + P::kABytes, 16);
      // slice j of the stage: 32 bytes further along the swizzled 128-byte rows
      auto desc_a = [&](int j) { return make_desc(a_lo + 2 * j, 1024, kSwizzle128); };
      auto desc_b = [&](int j) { return make_desc(b_lo + 2 * j, 1024, kSwizzle128); };
      wgmma_fence();
      wgmma_m64n128k32_set(part0, desc_a(0), desc_b(0));
      wgmma_commit();
      wgmma_m64n128k32_set(part1, desc_a(1), desc_b(1));
      wgmma_commit();
      wgmma_wait<1>();
      fence_regs(part0);
      promote(acc, part0, sa, sb, 0);
      wgmma_fence();
      wgmma_m64n128k32_set(part0, desc_a(2), desc_b(2));
      wgmma_commit();
      wgmma_wait<1>();
      fence_regs(part1);
      promote(acc, part1, sa, sb, 1);
      wgmma_fence();
      wgmma_m64n128k32_set(part1, desc_a(3), desc_b(3));
      wgmma_commit();
      wgmma_wait<1>();
      fence_regs(part0);
      promote(acc, part0, sa, sb, 2);
      wgmma_wait<0>();
      fence_regs(part1);
      if ((t % 32) == 0) mbar_arrive(empty0 + 8 * s);  // this warp is done with the stage
      promote(acc, part1, sa, sb, 3);
    }
    epilogue(p, acc, w.m0 + row_local, w.n0, w.split, t);
  }
}

template <int kConsumers, bool kAlignedScales>
int launch(const GemmParams* p, const void* a, long long lda, long long a_cols, const void* b, long long ldb,
           cudaStream_t stream) {
  using P = Plan<kConsumers>;
  static bool configured = false;
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(mxfp8_gemm_kernel<kConsumers, kAlignedScales>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, P::kSmemBytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  alignas(64) CUtensorMap map_a, map_b;
  if (!encode_operand_map(&map_a, a, p->m, a_cols, lda, P::kBlockM)) return -2;
  if (!encode_operand_map(&map_b, b, p->n, p->k_group, ldb, kBlockN)) return -2;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return static_cast<int>(err);
  const long long units = static_cast<long long>((p->m + P::kBlockM - 1) / P::kBlockM) *
                          ((p->n + kBlockN - 1) / kBlockN) * p->splits;
  const int grid = static_cast<int>(units < sms ? units : sms);  // persistent: one CTA per SM at most
  mxfp8_gemm_kernel<kConsumers, kAlignedScales><<<grid, P::kThreads, P::kSmemBytes, stream>>>(*p, map_a, map_b);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// a: e4m3 [M, a_cols] (row stride lda bytes), b: e4m3 [N, K] (row stride ldb). consumers: 1 (64-row
// tiles) or 2 (128-row tiles). Returns a cudaError_t (0 = success), -1 for a bad argument, or -2
// when the driver refuses a tensor map.
int mxfp8_gemm_sm90(const GemmParams* p, const void* a, long long lda, long long a_cols, const void* b,
                    long long ldb, int consumers, void* stream) {
  if (p->m <= 0 || p->n <= 0 || p->k_group <= 0 || p->splits < 1 || p->n % 2) return -1;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool aligned = p->scales_u32 != 0;
  if (consumers == 1 && aligned) return launch<1, true>(p, a, lda, a_cols, b, ldb, s);
  if (consumers == 1) return launch<1, false>(p, a, lda, a_cols, b, ldb, s);
  if (consumers == 2 && aligned) return launch<2, true>(p, a, lda, a_cols, b, ldb, s);
  if (consumers == 2) return launch<2, false>(p, a, lda, a_cols, b, ldb, s);
  return -1;
}

// Dynamic shared memory of a CTA with `consumers` consumer warpgroups (-1: not built).
int mxfp8_gemm_sm90_smem_bytes(int consumers) {
  return consumers == 1 ? Plan<1>::kSmemBytes : consumers == 2 ? Plan<2>::kSmemBytes : -1;
}

// The size of GemmParams as this library was built, checked against the ctypes mirror at load.
int mxfp8_gemm_sm90_params_bytes() { return static_cast<int>(sizeof(GemmParams)); }

}  // extern "C"
