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

#include "mxfp8_gemm_common.cuh"

namespace {

template <int kConsumers>
struct PlanV2 {
  static constexpr int kBlockM = kRowsPerConsumer * kConsumers;
  static constexpr int kABytes = kBlockM * kBlockK;
  static constexpr int kBBytes = kBlockN * kBlockK;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kThreads = 128 * (kConsumers + 1);  // + the producer warpgroup
  static constexpr int kScaleWords = kBlockM + kBlockN / 32;  // per stage: one per row of A, one per column block
  // per consumer warp, two buffers of [slice 4][row 2][quad 8] x 4 column-block products (fp32)
  static constexpr int kScratchBytesPerWarp = 2 * 4 * 2 * 8 * 16;
  static constexpr int kScratchBytes = 4 * kConsumers * kScratchBytesPerWarp;
  static constexpr int kPerStage = kStageBytes + 4 * kScaleWords + 16;  // + the stage's two mbarriers
  static constexpr int kLimit = 227 * 1024 - 1024;                      // - the 1024-byte alignment
  static constexpr int kStages = (kLimit - kScratchBytes) / kPerStage > 8 ? 8 : (kLimit - kScratchBytes) / kPerStage;
  static constexpr int kSmemBytes = 1024 + kStages * kPerStage + kScratchBytes;
};

// 2-D TMA box load delivered to the same shared-memory offset (and completing the mbarrier at
// the same offset) in every CTA of `mask`.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar,
                                                      uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "h"(mask) : "memory");
}

// Work unit u of a cluster: its CM x CN output tiles (grouped along M for L2 reuse of B) and its
// split of K; this CTA takes tile (cm, cn) of them.
struct ClusterUnit {
  int m0, n0, n0_cluster, split;
  template <int kBlockM, int CM, int CN>
  __device__ static ClusterUnit make(int u, int tiles_m, int tiles_n, int cm, int cn) {
    const int cl_m = (tiles_m + CM - 1) / CM, cl_n = (tiles_n + CN - 1) / CN;
    const int tiles = cl_m * cl_n, tile = u % tiles, group = kGroupM / CM, width = group * cl_n;
    const int first_m = (tile / width) * group, size_m = min(cl_m - first_m, group);
    const int tm = first_m + (tile % width) % size_m, tn = (tile % width) / size_m;
    return {(tm * CM + cm) * kBlockM, (tn * CN + cn) * kBlockN, tn * CN * kBlockN, u / tiles};
  }
};

// D[64 x 128] (+)= A[64 x 32] . B[128 x 32]^T (scale-d from `accumulate`), for the kPromote = false diagnostic.
__device__ __forceinline__ void wgmma_m64n128k32_acc(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// An arrival on a local (`remote` = false) or a cluster peer's mbarrier by the threads with
// `pred`. Release at CTA scope, as CUTLASS's cluster barriers do: what it orders are this warp's
// wgmma reads of the stage, complete at wgmma.wait_group (mbar_arrive_remote's .release.cluster
// puts a GPU-wide MEMBAR before every arrival).
template <bool kRemote>
__device__ __forceinline__ void mbar_arrive_if(uint32_t bar, bool pred) {
  if (kRemote)
    asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %1, 0;\n@p mbarrier.arrive.shared::cluster.b64 _, [%0];\n}\n"
                 ::"r"(bar), "r"(static_cast<uint32_t>(pred)) : "memory");
  else
    asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n"
                 ::"r"(bar), "r"(static_cast<uint32_t>(pred)) : "memory");
}

__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint4 lds_u128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float4 lds_f128(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void sts_f128(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

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

// The k-th work unit of this CTA, for a consumer's epilogue: everything recomputed from the
// launch (volatile reads of the grid shape and the cluster rank), so that none of it stays live
// in the registers of the wgmma loop.
template <int kBlockM, int CM, int CN>
__device__ __forceinline__ ClusterUnit consumer_unit(const GemmParams& p, int k) {
  uint32_t ctaid, nctaid;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(ctaid));
  asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(nctaid));
  const int rank = CM * CN > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int u = static_cast<int>(ctaid) / (CM * CN) + k * (static_cast<int>(nctaid) / (CM * CN));
  const int tiles_m = (p.m + kBlockM - 1) / kBlockM, tiles_n = (p.n + kBlockN - 1) / kBlockN;
  return ClusterUnit::make<kBlockM, CM, CN>(u, tiles_m, tiles_n, rank % CM, rank / CM);
}

template <int kConsumers, bool kAlignedScales, int CM, int CN, bool kPromote>
__global__ void __launch_bounds__(PlanV2<kConsumers>::kThreads, 1)
    mxfp8_gemm_v2_kernel(const GemmParams p, const __grid_constant__ CUtensorMap map_a,
                         const __grid_constant__ CUtensorMap map_b) {
  using P = PlanV2<kConsumers>;
  constexpr int kCluster = CM * CN;
  constexpr int kPeers = 1 + (CM > 1) + (CN > 1);  // CTAs whose stages a consumer releases (itself included)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t ring = smem_u32(smem);
  const uint32_t scratch0 = ring + P::kStages * P::kStageBytes;
  const uint32_t words0 = scratch0 + P::kScratchBytes;  // [stage][kScaleWords]
  uint32_t* words_g = reinterpret_cast<uint32_t*>(smem + P::kStages * P::kStageBytes + P::kScratchBytes);
  const uint32_t full0 = words0 + 4 * P::kStages * P::kScaleWords, empty0 = full0 + 8 * P::kStages;

  const int tiles_m = (p.m + P::kBlockM - 1) / P::kBlockM, tiles_n = (p.n + kBlockN - 1) / kBlockN;
  const int cluster_units = ((tiles_m + CM - 1) / CM) * ((tiles_n + CN - 1) / CN) * p.splits;
  const int cluster_id = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  const int rank = kCluster > 1 ? static_cast<int>(cluster_rank()) : 0, cm = rank % CM, cn = rank / CM;
  const int nb_total = (p.n + 31) / 32;
  const int kps = p.k_iters_per_split;  // every unit has this many stages (the host checks)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < P::kStages; ++s) {
      mbar_init_count(full0 + 8 * s, 1 + 32);  // the TMA's arming thread + the scale-copying lanes
      mbar_init_count(empty0 + 8 * s, 4 * kConsumers * kPeers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit and the peers
  }
  if (kCluster > 1) cluster_sync();  // the peers' mbarriers exist before anything reaches them
  else __syncthreads();

  if (warp >= 4 * kConsumers) {
    // producer warpgroup: lane 0 of its first warp issues the TMA loads, its second warp copies the
    // scale words (each its own loop over the same stages: 40 registers each); the rest wait at the end
    if (kConsumers == 2) setmaxnreg_dec<40>();
    if (warp == 4 * kConsumers && lane == 0) {
      const uint16_t mask_a = static_cast<uint16_t>((1u << cm) | (1u << (cm + CM)));  // same rows: (cm, 0), (cm, 1)
      const uint16_t mask_b = static_cast<uint16_t>(3u << (CM * cn));                 // same columns: (0, cn), (1, cn)
      int g = 0;  // stages loaded so far (ring position and phase)
      for (int u = cluster_id; u < cluster_units; u += clusters) {
        const ClusterUnit w = ClusterUnit::make<P::kBlockM, CM, CN>(u, tiles_m, tiles_n, cm, cn);
        const int ka0 = (w.n0_cluster / p.n_group) * p.k_group;  // this cluster's group's first K column of A
        // a cluster's tile past M (or N) still runs, its rows unscaled (scale words 0) and unwritten:
        // it loads rows that exist rather than a box wholly outside the tensor
        const int m0 = w.m0 < p.m ? w.m0 : 0, n0 = w.n0 < p.n ? w.n0 : 0;
        for (int it = w.split * kps, end = it + kps; it < end; ++it, ++g) {
          const int s = g % P::kStages, round = g / P::kStages;
          if (round > 0) mbar_wait_or_trap<false>(empty0 + 8 * s, (round - 1) & 1);
          const uint32_t bar = full0 + 8 * s;
          mbar_arm(bar, P::kStageBytes);  // both operands whole, whichever CTA of the cluster loads each half
          const uint32_t a_dst = ring + s * P::kStageBytes, b_dst = a_dst + P::kABytes;
          const int k = ka0 + it * kBlockK;
          if (CN == 1) tma_load_2d(a_dst, &map_a, k, m0, bar);
          else tma_load_2d_multicast(a_dst + cn * (P::kABytes / 2), &map_a, k, m0 + cn * (P::kBlockM / 2), bar, mask_a);
          if (CM == 1) tma_load_2d(b_dst, &map_b, it * kBlockK, n0, bar);
          else tma_load_2d_multicast(b_dst + cm * (P::kBBytes / 2), &map_b, it * kBlockK, n0 + cm * (kBlockN / 2), bar,
                                     mask_b);
        }
      }
    } else if (warp == 4 * kConsumers + 1) {
      int g = 0;
      for (int u = cluster_id; u < cluster_units; u += clusters) {
        const ClusterUnit w = ClusterUnit::make<P::kBlockM, CM, CN>(u, tiles_m, tiles_n, cm, cn);
        const int ka0 = (w.n0_cluster / p.n_group) * p.k_group;
        for (int it = w.split * kps, end = it + kps; it < end; ++it, ++g) {
          const int s = g % P::kStages, round = g / P::kStages;
          if (round > 0) mbar_wait_or_trap<false>(empty0 + 8 * s, (round - 1) & 1);
          const uint32_t bar = full0 + 8 * s;
          uint32_t* words = words_g + s * P::kScaleWords;
          const int kb = it * (kBlockK / 32);  // the stage's first slice
          if (kAlignedScales) {
#pragma unroll
            for (int i = 0; i < P::kBlockM / 32; ++i) {
              const int row = w.m0 + lane + 32 * i;
              const uint8_t* src = p.sa + (row < p.m ? row * p.ldsa + ka0 / 32 + kb : 0);
              cp_async_4(smem_u32(words + lane + 32 * i), src, row < p.m ? 4 : 0);
            }
            if (lane < kBlockN / 32) {
              const int nb = w.n0 / 32 + lane;
              const uint8_t* src = p.sb + (nb < nb_total ? nb * p.ldsb + kb : 0);
              cp_async_4(smem_u32(words + P::kBlockM + lane), src, nb < nb_total ? 4 : 0);
            }
            cp_async_arrive(bar);  // when this lane's copies land
          } else {
            const int valid = p.k_group / 32 - kb;
            for (int i = 0; i < P::kBlockM / 32; ++i) {
              const int row = w.m0 + lane + 32 * i;
              words[lane + 32 * i] = row < p.m ? scale_word_bytes(p.sa + row * p.ldsa + ka0 / 32 + kb, valid) : 0u;
            }
            if (lane < kBlockN / 32) {
              const int nb = w.n0 / 32 + lane;
              words[P::kBlockM + lane] = nb < nb_total ? scale_word_bytes(p.sb + nb * p.ldsb + kb, valid) : 0u;
            }
            mbar_arrive(bar);  // its plain stores are ordered by the release
          }
        }
      }
    }
  } else {
    // consumer warpgroup wg: rows m0 + 64 wg .. +63 of each tile
    if (kConsumers == 2) setmaxnreg_inc<232>();
    const int wg = warp / 4, t = threadIdx.x % 128;
    const int row_local = wg * kRowsPerConsumer + 16 * (t / 32) + (t % 32) / 4;  // and + 8
    const uint32_t scratch = scratch0 + warp * P::kScratchBytesPerWarp;
    // this lane's empty barrier to release (lanes < kPeers): its own CTA's, its B peer's, its A peer's
    uint32_t release = empty0;
    if (kCluster > 1 && lane < kPeers) {
      const int peer = lane == 0 ? rank : (lane == 1 && CM > 1 ? (1 - cm) + CM * cn : cm + CM * (1 - cn));
      release = peer_addr(empty0, static_cast<uint32_t>(peer));
    }
    auto release_stage = [&](int s) { mbar_arrive_if<(kCluster > 1)>(release + 8 * s, lane < kPeers); };
    const int mine = cluster_units > cluster_id ? (cluster_units - 1 - cluster_id) / clusters + 1 : 0;
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
  using P = PlanV2<kConsumers>;
  constexpr int kCluster = CM * CN;
  const auto kernel = mxfp8_gemm_v2_kernel<kConsumers, kAlignedScales, CM, CN, kPromote>;
  static bool configured = false;
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, P::kSmemBytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  alignas(64) CUtensorMap map_a, map_b;
  if (!encode_operand_map(&map_a, a, p->m, a_cols, lda, P::kBlockM / CN)) return -2;
  if (!encode_operand_map(&map_b, b, p->n, p->k_group, ldb, kBlockN / CM)) return -2;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return static_cast<int>(err);

  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(P::kThreads);
  cfg.dynamicSmemBytes = P::kSmemBytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = kCluster > 1 ? 1 : 0;  // a plain launch without clusters
  // persistent: as many clusters as can be resident at once (GPCs may not hold a multiple of the cluster size)
  static int resident[16] = {};
  int clusters = sms / kCluster;
  if (kCluster > 1 && device < 16) {
    if (resident[device] == 0) {
      cfg.gridDim = dim3(clusters * kCluster);
      err = cudaOccupancyMaxActiveClusters(&resident[device], kernel, &cfg);
      if (err != cudaSuccess) return static_cast<int>(err);
      if (resident[device] <= 0) return -3;
    }
    clusters = resident[device] < clusters ? resident[device] : clusters;
  }
  const long long tiles_m = (p->m + P::kBlockM - 1) / P::kBlockM, tiles_n = (p->n + kBlockN - 1) / kBlockN;
  const long long units = ((tiles_m + CM - 1) / CM) * ((tiles_n + CN - 1) / CN) * p->splits;
  cfg.gridDim = dim3(static_cast<unsigned>((units < clusters ? units : clusters) * kCluster));
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kernel, *p, map_a, map_b));
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
  return consumers == 1 ? PlanV2<1>::kSmemBytes : consumers == 2 ? PlanV2<2>::kSmemBytes : -1;
}

}  // extern "C"
