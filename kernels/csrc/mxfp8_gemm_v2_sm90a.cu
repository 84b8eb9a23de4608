// MXFP8 GEMM for Hopper (sm_90a), second version: the contract of kernels/csrc/mxfp8_gemm_sm90a.cu
// and the same numbers bit for bit (the same wgmma partials, promoted in the same order with the
// same fp32 scale products 2^(ea-127) * 2^(eb-127)). Launch choice and Python side:
// kernels/mxfp8_gemm_cuda.py. Why it differs from the first version (issue-slot budget and SASS
// counts in benchmarks/KERNEL_NOTES.md, "MXFP8 GEMM v2"):
//
// - Scale products once per quad. The four lanes of a quad hold the same two accumulator rows and
//   need the same 8 products (2 rows x the tile's 4 column blocks) for a slice. Once per stage,
//   lane q of each quad computes slice q's 8 products and stores them in its warp's scratch in
//   shared memory; a slice's promotion then reads them with two 16-byte loads, so the consumer's
//   issue slots go to the 64 FFMAs per slice rather than to byte extraction and FMULs.
// - wgmmas in flight across stages. A stage's four slices run promote 0, issue 2, promote 1,
//   issue 3, promote 2, then the next stage's slice 0 goes in before this stage's slice 3 is
//   promoted and its slice 1 right after (wgmma.wait_group 1 throughout, 0 only at a tile's last
//   stage, whose epilogue then runs from the registers). ptxas keeps them in flight (no C7510-
//   C7518 serialization) given two things: the promotions' FMAs pinned before the next wgmma on
//   their partial (fence_regs(acc)), and an explicit wgmma.wait_group 0 after the loop.
// - Clusters of CM x CN CTAs (1 or 2 each) with TMA multicast: the CTAs of a cluster that share
//   B (same columns, CM = 2) or A (same rows, CN = 2) each load half of that tile and multicast
//   it to both, cutting the L2 -> SM bytes per output by 25 % (one pair) or 50 % (2 x 2). A stage
//   is refilled only after the consumers of every CTA it is written to released it: each consumer
//   warp arrives on its own CTA's empty barrier and on those of its A and B peers.
// - The producer warpgroup's first warp (one lane) issues the TMA loads and its second warp copies
//   the scale words, each in its own loop over the same stages (the 40 registers the consumers
//   leave it do not hold both).
// - kPromote = false (a diagnostic for the benchmark, wrong numbers): the same pipeline with the
//   four slices accumulated by the tensor cores, no promotion; its time is this pipeline's
//   ceiling without the per-32 scales.
//
// Kept from the first version: persistent CTAs over work units (tile x K split), the scale words
// by cp.async completing on the stage's full barrier, 128 x 128 or 64 x 128 tiles, 128-byte
// swizzled K-major operands, the epilogues of mxfp8_gemm_common.cuh.

#include "mxfp8_gemm_pipeline.cuh"

namespace {

// This lane's share of a stage's scale products: slice q = lane % 4 for the quad's rows (the
// stage's scale words at `words`: row words at 4 * row, column-block words after kBlockM of
// them). Stored at scratch + ((q * 2 + r) * 8 + quad) * 16 as the 4 column blocks' products.
template <int kBlockM>
__device__ __forceinline__ void stage_products(uint32_t words, int row_local, uint32_t scratch, int lane) {
  const uint32_t q = lane % 4, quad = lane / 4, sel = 0x4440u | q;  // byte q of a word -> byte 0, zeros above
  const uint32_t wa0 = lds_u32(words + 4 * row_local), wa1 = lds_u32(words + 4 * (row_local + 8));
  const uint4 wb = lds_u128(words + 4 * kBlockM);
  const float fa0 = pow2_from_byte(__byte_perm(wa0, 0, sel)), fa1 = pow2_from_byte(__byte_perm(wa1, 0, sel));
  const float fb0 = pow2_from_byte(__byte_perm(wb.x, 0, sel)), fb1 = pow2_from_byte(__byte_perm(wb.y, 0, sel));
  const float fb2 = pow2_from_byte(__byte_perm(wb.z, 0, sel)), fb3 = pow2_from_byte(__byte_perm(wb.w, 0, sel));
  const uint32_t dst = scratch + ((q * 2) * 8 + quad) * 16;
  sts_f128(dst, fa0 * fb0, fa0 * fb1, fa0 * fb2, fa0 * fb3);
  sts_f128(dst + 8 * 16, fa1 * fb0, fa1 * fb1, fa1 * fb2, fa1 * fb3);
}

// acc += P . s for slice j: the products of rows r0 (lo) and r0 + 8 (hi) for the tile's column
// blocks; accumulator 4i + 2r + e is row r0 + 8r, column 8i + 2 (lane % 4) + e, in block i / 4.
__device__ __forceinline__ void promote_slice(float (&acc)[64], const float (&part)[64], uint32_t scratch, int j,
                                              int lane) {
  const uint32_t src = scratch + ((j * 2) * 8 + lane / 4) * 16;
  const float4 lo = lds_f128(src), hi = lds_f128(src + 8 * 16);
  const float s[2][4] = {{lo.x, lo.y, lo.z, lo.w}, {hi.x, hi.y, hi.z, hi.w}};
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int v = 0; v < 4; ++v) acc[4 * i + v] = fmaf(part[4 * i + v], s[v >> 1][i >> 2], acc[4 * i + v]);
  fence_regs(acc);  // done here: the compiler must not sink these FMAs past the next wgmma on `part`
}

template <int kConsumers, bool kAlignedScales, int CM, int CN, bool kPromote>
__global__ void __launch_bounds__(PipelinePlan<kConsumers>::kThreads, 1)
    mxfp8_gemm_v2_kernel(const GemmParams p, const __grid_constant__ CUtensorMap map_a,
                         const __grid_constant__ CUtensorMap map_b) {
  using P = PipelinePlan<kConsumers>;
  using Cta = PipelineCta<kConsumers, CM, CN>;
  constexpr int kCluster = Cta::kCluster, kPeers = Cta::kPeers;
  extern __shared__ uint8_t smem_raw[];
  const Cta cta(p, smem_raw);
  const uint32_t ring = cta.ring, scratch0 = cta.scratch0, words0 = cta.words0, full0 = cta.full0, empty0 = cta.empty0;
  const int cm = cta.cm, cn = cta.cn;
  const int kps = p.k_iters_per_split;  // every unit has this many stages (the host checks)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  cta.init_barriers();

  if (warp >= 4 * kConsumers) {  // the producer warpgroup (its idle warps wait at the end)
    if (kConsumers == 2) setmaxnreg_dec<40>();
    run_producer<kConsumers, kAlignedScales, CM, CN>(p, map_a, map_b, ring, cta.words_g, full0, empty0, cm, cn, warp,
                                                     lane);
  } else {
    // consumer warpgroup wg: rows m0 + 64 wg .. +63 of each tile
    if (kConsumers == 2) setmaxnreg_inc<232>();
    const int wg = warp / 4, t = threadIdx.x % 128;
    const int row_local = wg * kRowsPerConsumer + 16 * (t / 32) + (t % 32) / 4;  // and + 8
    const uint32_t scratch = scratch0 + warp * P::kScratchBytesPerWarp;
    const uint32_t release = cta.release_barrier(lane);  // lanes < kPeers release a stage
    auto release_stage = [&](int s) { mbar_arrive_if<(kCluster > 1)>(release + 8 * s, lane < kPeers); };
    const int mine = cta.units_mine();
    const int total = mine * kps;  // stages this CTA runs
    // shared-memory descriptors of stage 0's slice 0 (start address in 16-byte units: a stage is
    // kStageBytes / 16 further, a 32-byte slice 2 further; the ring stays under the field's 256 KB)
    const uint32_t a_lo0 = desc_lo(ring + wg * kRowsPerConsumer * kBlockK, 16), b_lo0 = desc_lo(ring + P::kABytes, 16);
    constexpr uint32_t kStageDesc = P::kStageBytes / 16;
    auto desc = [](uint32_t lo) { return make_desc(lo, 1024, kSwizzle128); };
    int units_done = 0, in_unit = 0;
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;

    if (!kPromote) {  // diagnostic: the tensor cores accumulate the four slices, no scales
      for (int i = 0; i < total; ++i) {
        const int s = i % P::kStages;
        mbar_wait_or_trap<false>(full0 + 8 * s, (i / P::kStages) & 1);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j)
          wgmma_m64n128k32_acc(acc, desc(a_lo0 + s * kStageDesc + 2 * j), desc(b_lo0 + s * kStageDesc + 2 * j),
                               in_unit > 0 || j > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(acc);
        release_stage(s);
        if (++in_unit == kps) {
          const ClusterUnit w = consumer_unit<P::kBlockM, CM, CN>(p, units_done++);
          epilogue(p, acc, w.m0 + row_local, w.n0, w.split, t);
          in_unit = 0;
        }
      }
    } else if (total > 0) {
      float part0[64], part1[64];
      // ring position and full-barrier parity of the current stage and of the next one
      int s = 0, s1 = P::kStages > 1 ? 1 : 0;
      uint32_t phase = 0, phase1 = P::kStages > 1 ? 0 : 1;
      uint32_t buf = scratch, buf1 = scratch + P::kScratchBytesPerWarp / 2;  // this stage's products, the next one's
      // a unit's first stage: wait for it, slices 0 and 1 in flight, and (separately) its products
      auto begin_stage = [&]() {
        mbar_wait_or_trap<false>(full0 + 8 * s, phase);
        const uint32_t a_lo = a_lo0 + s * kStageDesc, b_lo = b_lo0 + s * kStageDesc;
        wgmma_fence();
        wgmma_m64n128k32_set(part0, desc(a_lo), desc(b_lo));
        wgmma_commit();
        wgmma_m64n128k32_set(part1, desc(a_lo + 2), desc(b_lo + 2));
        wgmma_commit();
      };
      auto begin_products = [&]() {
        stage_products<P::kBlockM>(words0 + 4 * s * P::kScaleWords, row_local, buf, lane);
        __syncwarp();
      };
      begin_stage();
      begin_products();
      for (int i = 0; i < total; ++i) {
        // slices 0 and 1 of stage i (ring slot s) are in flight; its products are in `buf`
        const bool unit_goes_on = in_unit + 1 < kps;
        const uint32_t a_lo = a_lo0 + s * kStageDesc, b_lo = b_lo0 + s * kStageDesc;
        const uint32_t a_lo1 = a_lo0 + s1 * kStageDesc, b_lo1 = b_lo0 + s1 * kStageDesc;
        wgmma_wait<1>();
        fence_regs(part0);
        promote_slice(acc, part0, buf, 0, lane);
        wgmma_fence();
        wgmma_m64n128k32_set(part0, desc(a_lo + 4), desc(b_lo + 4));
        wgmma_commit();
        if (unit_goes_on) {  // the next stage's products, under slices 1 and 2
          mbar_wait_or_trap<false>(full0 + 8 * s1, phase1);
          stage_products<P::kBlockM>(words0 + 4 * s1 * P::kScaleWords, row_local, buf1, lane);
          __syncwarp();
        }
        wgmma_wait<1>();
        fence_regs(part1);
        promote_slice(acc, part1, buf, 1, lane);
        wgmma_fence();
        wgmma_m64n128k32_set(part1, desc(a_lo + 6), desc(b_lo + 6));
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs(part0);
        promote_slice(acc, part0, buf, 2, lane);
        if (unit_goes_on) {  // the next stage's first slice goes in before this one's last promotion
          wgmma_fence();
          wgmma_m64n128k32_set(part0, desc(a_lo1), desc(b_lo1));
          wgmma_commit();
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        fence_regs(part1);
        release_stage(s);  // this warp is done with slot s (its scale words were read before)
        promote_slice(acc, part1, buf, 3, lane);
        s = s1;
        phase = phase1;
        s1 = s1 + 1 == P::kStages ? 0 : s1 + 1;
        phase1 = s1 == 0 ? phase1 ^ 1u : phase1;
        const uint32_t b = buf;
        buf = buf1;
        buf1 = b;
        if (unit_goes_on) {
          wgmma_fence();
          wgmma_m64n128k32_set(part1, desc(a_lo1 + 2), desc(b_lo1 + 2));
          wgmma_commit();
          ++in_unit;
        } else {  // the unit's tile is complete
          const ClusterUnit w = consumer_unit<P::kBlockM, CM, CN>(p, units_done++);
          if (p.mode == MODE_BF16 && i + 1 < total) {  // the next tile's first slices run under this one's stores
            begin_stage();
            epilogue_bf16(p, acc, w.m0 + row_local, w.n0, t);
          } else {
            epilogue(p, acc, w.m0 + row_local, w.n0, w.split, t);
            if (i + 1 < total) begin_stage();
          }
#pragma unroll
          for (int e = 0; e < 64; ++e) acc[e] = 0.f;
          if (i + 1 < total) begin_products();
          in_unit = 0;
        }
      }
      wgmma_wait<0>();  // nothing is in flight here (the last stage waited for all): said for ptxas's sake
    }
  }
  if (kCluster > 1) cluster_sync();  // no CTA leaves while a peer may still reach its shared memory
}

template <int kConsumers, bool kAlignedScales, int CM, int CN, bool kPromote>
int launch_v2(const GemmParams* p, const void* a, long long lda, long long a_cols, const void* b, long long ldb,
              cudaStream_t stream) {
  return launch_pipelined<mxfp8_gemm_v2_kernel<kConsumers, kAlignedScales, CM, CN, kPromote>, kConsumers, CM, CN>(
      p, a, lda, a_cols, b, ldb, stream);
}

}  // namespace

extern "C" {

// The second version (same arguments as mxfp8_gemm_sm90 in mxfp8_gemm_sm90a.cu, plus the cluster
// shape cluster_m x cluster_n, 1 or 2 each, and promote = 0 for the benchmark's no-scale
// diagnostic). Built: 64-row tiles without clusters; 128-row tiles with unaligned scale rows
// without clusters; 128-row tiles with aligned scale rows in every cluster shape (and promote = 0
// for 1 x 1 and 2 x 1). Returns a cudaError_t, -1 for a bad or unbuilt argument combination, -2
// when the driver refuses a tensor map, -3 when no cluster of that shape fits on the GPU.
int mxfp8_gemm_sm90_v2(const GemmParams* p, const void* a, long long lda, long long a_cols, const void* b,
                       long long ldb, int consumers, int cluster_m, int cluster_n, int promote, void* stream) {
  if (p->m <= 0 || p->n <= 0 || p->k_group <= 0 || p->splits < 1 || p->n % 2) return -1;
  const int k_stages = (p->k_group + kBlockK - 1) / kBlockK;
  if (p->k_iters_per_split * p->splits != k_stages) return -1;
  if (cluster_n == 2 && p->n_group % (2 * kBlockN) != 0) return -1;  // an A tile shared by two groups' columns
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool aligned = p->scales_u32 != 0;
  const int shape = cluster_m * 10 + cluster_n;
  if (promote == 0) {
    if (consumers != 2 || !aligned) return -1;
    if (shape == 11) return launch_v2<2, true, 1, 1, false>(p, a, lda, a_cols, b, ldb, s);
    if (shape == 21) return launch_v2<2, true, 2, 1, false>(p, a, lda, a_cols, b, ldb, s);
    return -1;
  }
  if (consumers == 1 && shape == 11) {
    return aligned ? launch_v2<1, true, 1, 1, true>(p, a, lda, a_cols, b, ldb, s)
                   : launch_v2<1, false, 1, 1, true>(p, a, lda, a_cols, b, ldb, s);
  }
  if (consumers != 2) return -1;
  if (!aligned) return shape == 11 ? launch_v2<2, false, 1, 1, true>(p, a, lda, a_cols, b, ldb, s) : -1;
  if (shape == 11) return launch_v2<2, true, 1, 1, true>(p, a, lda, a_cols, b, ldb, s);
  if (shape == 21) return launch_v2<2, true, 2, 1, true>(p, a, lda, a_cols, b, ldb, s);
  if (shape == 12) return launch_v2<2, true, 1, 2, true>(p, a, lda, a_cols, b, ldb, s);
  if (shape == 22) return launch_v2<2, true, 2, 2, true>(p, a, lda, a_cols, b, ldb, s);
  return -1;
}

// Dynamic shared memory of a CTA of the second version with `consumers` consumer warpgroups (-1: not built).
int mxfp8_gemm_sm90_v2_smem_bytes(int consumers) {
  return consumers == 1 ? PipelinePlan<1>::kSmemBytes : consumers == 2 ? PipelinePlan<2>::kSmemBytes : -1;
}

}  // extern "C"
