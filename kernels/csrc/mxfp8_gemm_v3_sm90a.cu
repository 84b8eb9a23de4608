// MXFP8 GEMM for Hopper (sm_90a), third version: the contract of kernels/csrc/mxfp8_gemm_sm90a.cu
// and the same numbers bit for bit (each 32-wide K slice's fp32 partial promoted into the
// accumulator with the same fp32 scale product 2^(ea-127) * 2^(eb-127), slices in K order for
// every output). Launch choice and Python side: kernels/mxfp8_gemm_cuda.py. Why it differs from
// the first two (budget per option in benchmarks/KERNEL_NOTES.md, "MXFP8 GEMM v3"):
//
// - Units of half a tile. A warpgroup's 64 x 128 share of a slice is two wgmmas m64n64k32 (a
//   unit each: 32 tensor cycles of the SM, a 32-register partial), not one m64n128k32, so the
//   same 128 partial registers hold four units instead of two. A unit is promoted as soon as it
//   lands while the next three stay queued: wgmma.wait_group 3, 32 FFMAs, the next unit into the
//   freed set. Per warpgroup 96 tensor cycles stay queued under each promotion (v1 and v2: 64,
//   under a promotion twice as long), so the two warpgroups' promotions, which coincide (they
//   wait on the same stages), run under ~192 queued tensor cycles instead of ~128.
// - In flight across stages and tiles: the next stage's first four units are issued from the
//   last four promotions of this one (its full barrier waited for there), so the queue never
//   drains inside a work unit; with bf16 output also not at a tile's end: the next tile's first
//   four units run under this tile's epilogue. The other outputs drain at a tile's end (their
//   epilogues do not fit beside 128 registers of partials in flight).
// - A and B from shared memory. Each slice's A is read twice (once per unit): 192 bytes of shared
//   memory per tensor cycle at the tensor pipe's peak with the TMA writes (v1: 160), a ceiling of
//   ~67 % of peak, above the target (~50 %). A from registers (one ldmatrix per slice for both
//   units) does not fit beside 4 x 32 partials and 64 accumulators: 1.1-1.6 KB of spills. It is
//   kept for the no-promotion diagnostic (kRegA), whose comparison with the shared-memory one
//   measures what the second read of A costs.
// - Scale products as in v2: once per stage, lane q of each quad computes slice q's 8 products
//   (2 rows x 4 column blocks) into its warp's scratch; a unit reads its 4 (2 rows x its 2 column
//   blocks) with one 16-byte load.
// - kPromote = false (the benchmark's diagnostic, not the MXFP8 numbers): the same units, sets,
//   waits and loads, each set accumulating its units in the tensor cores (scale-d 1), no scale
//   products and no FFMAs; a tile's output is the sum of its sets (the unscaled FP8 product). It
//   drains at every tile's end. Its time is this pipeline's ceiling without the per-32 promotion.
// - ptxas 13.0 serialized every wgmma of this schedule (C7514) until each copy of the stage had a
//   conditional trap among its units: a loop that keeps wgmmas in flight across its back edge is
//   accepted only with one (a ten-line probe reproduces it; v2 passes because its stage wait,
//   mbar_wait_or_trap, has one). The copies that wait for the next stage have it there; the
//   draining copy re-waits its own, complete, full barrier for it.
//
// Kept from v2 (kernels/csrc/mxfp8_gemm_pipeline.cuh): persistent CTAs over work units (tile x K
// split), 128 x 128 or 64 x 128 tiles in 6 stages of 128 K, the producer warps, clusters of CM x
// CN CTAs with TMA multicast, the epilogues of mxfp8_gemm_common.cuh.

#include <type_traits>

#include "mxfp8_gemm_pipeline.cuh"

namespace {

constexpr int kSets = 4;          // a warpgroup's partial register sets (units in flight + the one promoted)
constexpr int kUnitsPerStage = 8;  // 4 slices x 2 halves of the tile's 128 columns
constexpr uint32_t kHalfDesc = kRowsPerConsumer * kBlockK / 16;  // B rows 64.. of a stage (descriptor units)

// Four 8 x 16-byte matrices from shared memory (lanes 8i..8i+7 give matrix i's row addresses);
// register i of lane l holds bytes 4 (l % 4)..+3 of row l / 4 of matrix i.
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// This lane's share of a stage's scale products: slice q = lane % 4 for the quad's rows r0
// (lo), r0 + 8 (hi) and the tile's column blocks c: half h of slice q at
// scratch + ((2q + h) * 8 + quad) * 16 holds {lo x c(2h), lo x c(2h+1), hi x c(2h), hi x c(2h+1)}.
// The stage's scale words at `words`: row words at 4 * row, column-block words after kBlockM.
template <int kBlockM>
__device__ __forceinline__ void stage_products(uint32_t words, int row_local, uint32_t scratch, int lane) {
  const uint32_t q = lane % 4, quad = lane / 4, sel = 0x4440u | q;  // byte q of a word -> byte 0, zeros above
  const uint32_t wa0 = lds_u32(words + 4 * row_local), wa1 = lds_u32(words + 4 * (row_local + 8));
  const uint4 wb = lds_u128(words + 4 * kBlockM);
  const float fa0 = pow2_from_byte(__byte_perm(wa0, 0, sel)), fa1 = pow2_from_byte(__byte_perm(wa1, 0, sel));
  const float fb0 = pow2_from_byte(__byte_perm(wb.x, 0, sel)), fb1 = pow2_from_byte(__byte_perm(wb.y, 0, sel));
  const float fb2 = pow2_from_byte(__byte_perm(wb.z, 0, sel)), fb3 = pow2_from_byte(__byte_perm(wb.w, 0, sel));
  const uint32_t dst = scratch + ((q * 2) * 8 + quad) * 16;
  sts_f128(dst, fa0 * fb0, fa0 * fb1, fa1 * fb0, fa1 * fb1);
  sts_f128(dst + 8 * 16, fa0 * fb2, fa0 * fb3, fa1 * fb2, fa1 * fb3);
}

// acc += P . s for the unit (slice j, half h): partial element 4i + 2r + e is row r0 + 8r, column
// 64h + 8i + 2 (lane % 4) + e, i.e. accumulator 32h + 4i + 2r + e (v1's layout), column block
// 2h + i / 4.
template <int kJ, int kH>
__device__ __forceinline__ void promote_unit(float (&acc)[64], const float (&part)[32], uint32_t scratch, int lane) {
  const float4 s = lds_f128(scratch + ((kJ * 2 + kH) * 8 + lane / 4) * 16);
  const float sc[2][2] = {{s.x, s.y}, {s.z, s.w}};
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int v = 0; v < 4; ++v)
      acc[32 * kH + 4 * i + v] = fmaf(part[4 * i + v], sc[v >> 1][i >> 2], acc[32 * kH + 4 * i + v]);
  // done here: the compiler must not sink these FMAs past the next wgmma on `part`
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(acc[32 * kH + i])::"memory");
}

// wgmma.wait_group min(n, 3), n known at compile time after unrolling
__device__ __forceinline__ void wgmma_wait_upto3(int n) {
  if (n >= 3) wgmma_wait<3>();
  else if (n == 2) wgmma_wait<2>();
  else if (n == 1) wgmma_wait<1>();
  else wgmma_wait<0>();
}

template <int kConsumers, bool kAlignedScales, int CM, int CN, bool kPromote, bool kRegA>
__global__ void __launch_bounds__(PipelinePlan<kConsumers>::kThreads, 1)
    mxfp8_gemm_v3_kernel(const GemmParams p, const __grid_constant__ CUtensorMap map_a,
                         const __grid_constant__ CUtensorMap map_b) {
  static_assert(!(kPromote && kRegA), "A from registers is built for the no-promotion diagnostic only (registers)");
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
    const int mine = cta.units_mine();
    // descriptors of stage 0's slice 0 (16-byte units: a stage is kStageBytes / 16 further, a
    // slice 2, B's second half kHalfDesc; the ring stays under the field's 256 KB)
    // (broadcast from lane 0: ptxas then keeps them, and each unit's descriptors, in uniform registers)
    const uint32_t a_lo0 = __shfl_sync(0xFFFFFFFFu, desc_lo(ring + wg * kRowsPerConsumer * kBlockK, 16), 0);
    const uint32_t b_lo0 = desc_lo(ring + P::kABytes, 16);
    constexpr uint32_t kStageDesc = P::kStageBytes / 16;
    auto desc = [](uint32_t lo) { return make_desc(lo, 1024, kSwizzle128); };
    // ldmatrix rows of this lane (kRegA, diagnostic only): matrix lane / 8 = (rows + 8 (lane / 8 % 2), 16-byte chunk
    // 2j + lane / 16 of slice j); the 128-byte swizzle XORs the chunk with the row % 8
    const uint32_t a_rows = ring + (wg * kRowsPerConsumer + 16 * (t / 32) + 8 * ((lane >> 3) & 1) + (lane & 7)) * kBlockK;
    const uint32_t a_chunk = (((lane & 7) ^ (lane >> 4)) << 4);

    float acc[64];
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[e] = 0.f;
    float part[kSets][32];
    uint32_t frag[4][4];  // kRegA: slice j's A fragment
    int s = 0, s1 = P::kStages > 1 ? 1 : 0;  // ring slots of this stage and the next
    uint32_t phase = 0, phase1 = P::kStages > 1 ? 0 : 1;
    uint32_t buf = scratch, buf1 = scratch + P::kScratchBytesPerWarp / 2;  // this stage's products, the next one's

    auto release_stage = [&](int slot) { mbar_arrive_if<(kCluster > 1)>(release + 8 * slot, lane < kPeers); };
    // unit (slice kJ, half kH) of ring slot `slot` into set kSet; kAcc: scale-d 1 (diagnostic only)
    auto issue = [&](auto set_tag, auto j_tag, auto h_tag, auto acc_tag, int slot) {
      constexpr int kSet = decltype(set_tag)::value, kJ = decltype(j_tag)::value, kH = decltype(h_tag)::value;
      if (kRegA && kH == 0) ldsm_x4(a_rows + slot * P::kStageBytes + ((32 * kJ) ^ a_chunk), frag[kJ]);
      wgmma_fence();
      const uint64_t db = desc(b_lo0 + slot * kStageDesc + 2 * kJ + kH * kHalfDesc);
      if (kRegA) wgmma_m64n64k32_rs(part[kSet], frag[kJ], db, decltype(acc_tag)::value);
      else wgmma_m64n64k32(part[kSet], desc(a_lo0 + slot * kStageDesc + 2 * kJ), db, decltype(acc_tag)::value);
      wgmma_commit();
    };
    using I0 = std::integral_constant<int, 0>;
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
    using I3 = std::integral_constant<int, 3>;
    using Accumulate = std::integral_constant<bool, !kPromote>;
    // a unit's first stage (the pipeline empty): wait for it, its products, its first four units
    auto begin_stage = [&]() {
      mbar_wait_or_trap<false>(full0 + 8 * s, phase);
      if (kPromote) {
        stage_products<P::kBlockM>(words0 + 4 * s * P::kScaleWords, row_local, buf, lane);
        __syncwarp();
      }
      issue(I0{}, I0{}, I0{}, std::false_type{}, s);
      issue(I1{}, I0{}, I1{}, std::false_type{}, s);
      issue(I2{}, I1{}, I0{}, std::false_type{}, s);
      issue(I3{}, I1{}, I1{}, std::false_type{}, s);
    };
    // unit k of this stage (set k % 4) is promoted; unit k + 4 goes into its set: this stage's
    // slices 2 and 3, then (kNext) the next stage's slices 0 and 1, whose full barrier and
    // products come first. Without kNext the queue drains: wait_group 3, 3, 3, 3, 3, 2, 1, 0.
    auto run_stage = [&](auto next_tag) {
      constexpr bool kNext = decltype(next_tag)::value;
#pragma unroll
      for (int k = 0; k < kUnitsPerStage; ++k) {
        wgmma_wait_upto3(kNext || k < 4 ? 3 : 7 - k);
        fence_regs(part[k % kSets]);
        if (k == kUnitsPerStage - 1) release_stage(s);  // every unit of slot s landed
        if (kPromote) {
          if (k == 0) promote_unit<0, 0>(acc, part[0], buf, lane);
          if (k == 1) promote_unit<0, 1>(acc, part[1], buf, lane);
          if (k == 2) promote_unit<1, 0>(acc, part[2], buf, lane);
          if (k == 3) promote_unit<1, 1>(acc, part[3], buf, lane);
          if (k == 4) promote_unit<2, 0>(acc, part[0], buf, lane);
          if (k == 5) promote_unit<2, 1>(acc, part[1], buf, lane);
          if (k == 6) promote_unit<3, 0>(acc, part[2], buf, lane);
          if (k == 7) promote_unit<3, 1>(acc, part[3], buf, lane);
        }
        if (k == 0) issue(I0{}, I2{}, I0{}, Accumulate{}, s);
        if (k == 1) issue(I1{}, I2{}, I1{}, Accumulate{}, s);
        if (k == 2) issue(I2{}, I3{}, I0{}, Accumulate{}, s);
        if (k == 3) issue(I3{}, I3{}, I1{}, Accumulate{}, s);
        if (!kNext && k == 4) mbar_wait_or_trap<false>(full0 + 8 * s, phase);  // complete: for ptxas (above)
        if (kNext) {
          if (k == 4) {
            mbar_wait_or_trap<false>(full0 + 8 * s1, phase1);
            issue(I0{}, I0{}, I0{}, Accumulate{}, s1);
            if (kPromote) {  // the next stage's products, under its first units
              stage_products<P::kBlockM>(words0 + 4 * s1 * P::kScaleWords, row_local, buf1, lane);
              __syncwarp();
            }
          }
          if (k == 5) issue(I1{}, I0{}, I1{}, Accumulate{}, s1);
          if (k == 6) issue(I2{}, I1{}, I0{}, Accumulate{}, s1);
          if (k == 7) issue(I3{}, I1{}, I1{}, Accumulate{}, s1);
        }
      }
    };

    auto advance = [&]() {
      s = s1;
      phase = phase1;
      s1 = s1 + 1 == P::kStages ? 0 : s1 + 1;
      phase1 = s1 == 0 ? phase1 ^ 1u : phase1;
      const uint32_t b = buf;
      buf = buf1;
      buf1 = b;
    };
    // Every edge into a stage carries units 0-3 of that stage in flight, in set order (ptxas
    // proves each promotion's set complete only then; a path with nothing in flight into the same
    // code, even an infeasible one, serializes every wgmma: C7514).
    if (mine > 0) begin_stage();
    for (int u = 0; u < mine; ++u) {
      for (int it = 1; it < kps; ++it) {  // stages of the tile before its last: always continue
        run_stage(std::true_type{});
        advance();
      }
      const bool more = u + 1 < mine;
      const bool next = more && kPromote && p.mode == MODE_BF16;  // the next tile's units under this epilogue
      if (next) run_stage(std::true_type{});
      else run_stage(std::false_type{});
      advance();
      const ClusterUnit w = consumer_unit<P::kBlockM, CM, CN>(p, u);
      if (!kPromote) {  // the sets' sums: half 0 in sets 0 and 2, half 1 in sets 1 and 3
#pragma unroll
        for (int e = 0; e < 32; ++e) {
          acc[e] = part[0][e] + part[2][e];
          acc[32 + e] = part[1][e] + part[3][e];
        }
      }
      if (next) epilogue_bf16(p, acc, w.m0 + row_local, w.n0, t);
      else epilogue(p, acc, w.m0 + row_local, w.n0, w.split, t);
#pragma unroll
      for (int e = 0; e < 64; ++e) acc[e] = 0.f;
      if (!next && more) begin_stage();
    }
    wgmma_wait<0>();  // nothing is in flight here (the last stage waited for all): said for ptxas's sake
  }
  if (kCluster > 1) cluster_sync();  // no CTA leaves while a peer may still reach its shared memory
}

template <int kConsumers, bool kAlignedScales, int CM, int CN, bool kPromote, bool kRegA>
int launch_v3(const GemmParams* p, const void* a, long long lda, long long a_cols, const void* b, long long ldb,
              cudaStream_t stream) {
  return launch_pipelined<mxfp8_gemm_v3_kernel<kConsumers, kAlignedScales, CM, CN, kPromote, kRegA>, kConsumers, CM,
                          CN>(p, a, lda, a_cols, b, ldb, stream);
}

}  // namespace

extern "C" {

// The third version (the arguments of mxfp8_gemm_sm90_v2; promote = 0 is the benchmark's
// no-promotion diagnostic, where a_regs = 1 reads A from registers). Built: 64-row tiles and
// unaligned scale rows without clusters; 128-row tiles with aligned scale rows in clusters 1 x 1
// and 2 x 1, with and without promotion (A from registers: without promotion, 1 x 1). Returns a
// cudaError_t, -1 for a bad or unbuilt argument combination, -2 when the driver refuses a tensor
// map, -3 when no cluster of that shape fits on the GPU.
int mxfp8_gemm_sm90_v3(const GemmParams* p, const void* a, long long lda, long long a_cols, const void* b,
                       long long ldb, int consumers, int cluster_m, int cluster_n, int promote, int a_regs,
                       void* stream) {
  if (p->m <= 0 || p->n <= 0 || p->k_group <= 0 || p->splits < 1 || p->n % 2) return -1;
  const int k_stages = (p->k_group + kBlockK - 1) / kBlockK;
  if (p->k_iters_per_split * p->splits != k_stages) return -1;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool aligned = p->scales_u32 != 0;
  const int shape = cluster_m * 10 + cluster_n;
  if (promote && a_regs) return -1;
  if (consumers == 1 || !aligned) {
    if (shape != 11 || !promote || (consumers != 1 && consumers != 2)) return -1;
    if (consumers == 1) {
      return aligned ? launch_v3<1, true, 1, 1, true, false>(p, a, lda, a_cols, b, ldb, s)
                     : launch_v3<1, false, 1, 1, true, false>(p, a, lda, a_cols, b, ldb, s);
    }
    return launch_v3<2, false, 1, 1, true, false>(p, a, lda, a_cols, b, ldb, s);
  }
  if (consumers != 2) return -1;
  switch (shape * 4 + (promote ? 2 : 0) + (a_regs ? 1 : 0)) {
    case 11 * 4 + 2: return launch_v3<2, true, 1, 1, true, false>(p, a, lda, a_cols, b, ldb, s);
    case 21 * 4 + 2: return launch_v3<2, true, 2, 1, true, false>(p, a, lda, a_cols, b, ldb, s);
    case 11 * 4 + 0: return launch_v3<2, true, 1, 1, false, false>(p, a, lda, a_cols, b, ldb, s);
    case 21 * 4 + 0: return launch_v3<2, true, 2, 1, false, false>(p, a, lda, a_cols, b, ldb, s);
    case 11 * 4 + 1: return launch_v3<2, true, 1, 1, false, true>(p, a, lda, a_cols, b, ldb, s);
    default: return -1;
  }
}

// Dynamic shared memory of a CTA of the third version (the second's plan) with `consumers` consumer
// warpgroups (-1: not built).
int mxfp8_gemm_sm90_v3_smem_bytes(int consumers) {
  return consumers == 1 ? PipelinePlan<1>::kSmemBytes : consumers == 2 ? PipelinePlan<2>::kSmemBytes : -1;
}

}  // extern "C"
