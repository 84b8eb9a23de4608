// The TMA pipeline of the second MXFP8 GEMM kernel (kernels/csrc/mxfp8_gemm_v2_sm90a.cu): its
// shared-memory plan, the work units of CTA clusters, the producer warpgroup (TMA loads with
// multicast; the stage's scale words by cp.async), the small shared-memory accessors and the
// cluster launch. The consumers (wgmma and promotion schedule) are in the kernel's file.
#pragma once

#include "mxfp8_gemm_common.cuh"

namespace {

// Shared memory of a CTA: the ring of stages (A rows then B rows, 128 K bytes each), each consumer
// warp's scratch for scale products, the stages' scale words, the stages' full and empty mbarriers.
template <int kConsumers>
struct PipelinePlan : TileGeometry<kConsumers> {
  using G = TileGeometry<kConsumers>;
  // per consumer warp, two buffers of 4 slices x 2 x 8 quads x 4 scale products (fp32)
  static constexpr int kScratchBytesPerWarp = 2 * 4 * 2 * 8 * 16;
  static constexpr int kScratchBytes = 4 * kConsumers * kScratchBytesPerWarp;
  static constexpr int kPerStage = G::kStageBytes + 4 * G::kScaleWords + 16;  // + the stage's two mbarriers
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

// What every CTA of the pipelined kernel (v2) derives before its warpgroups split: the shared
// memory layout (the stage ring, the consumers' scratch, the scale words, the full and empty
// mbarriers), its cluster rank and the cluster work units, and which empty barrier each of its
// consumer lanes releases.
template <int kConsumers, int CM, int CN>
struct PipelineCta {
  using P = PipelinePlan<kConsumers>;
  static constexpr int kCluster = CM * CN;
  static constexpr int kPeers = 1 + (CM > 1) + (CN > 1);  // CTAs whose stages a consumer releases (itself included)
  uint32_t ring, scratch0, words0, full0, empty0;
  uint32_t* words_g;  // [stage][kScaleWords]
  int cluster_units, cluster_id, clusters, rank, cm, cn;

  __device__ __forceinline__ PipelineCta(const GemmParams& p, uint8_t* smem_raw) {
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    ring = smem_u32(smem);
    scratch0 = ring + P::kStages * P::kStageBytes;
    words0 = scratch0 + P::kScratchBytes;
    words_g = reinterpret_cast<uint32_t*>(smem + P::kStages * P::kStageBytes + P::kScratchBytes);
    full0 = words0 + 4 * P::kStages * P::kScaleWords;
    empty0 = full0 + 8 * P::kStages;
    const int tiles_m = (p.m + P::kBlockM - 1) / P::kBlockM, tiles_n = (p.n + kBlockN - 1) / kBlockN;
    cluster_units = ((tiles_m + CM - 1) / CM) * ((tiles_n + CN - 1) / CN) * p.splits;
    cluster_id = blockIdx.x / kCluster;
    clusters = gridDim.x / kCluster;
    rank = kCluster > 1 ? static_cast<int>(cluster_rank()) : 0;
    cm = rank % CM;
    cn = rank / CM;
  }

  // Thread 0 initializes the stages' mbarriers; the cluster (or CTA) then syncs, so the peers'
  // mbarriers exist before anything reaches them.
  __device__ __forceinline__ void init_barriers() const {
    if (threadIdx.x == 0) {
      for (int s = 0; s < P::kStages; ++s) {
        mbar_init_count(full0 + 8 * s, 1 + 32);  // the TMA's arming thread + the scale-copying lanes
        mbar_init_count(empty0 + 8 * s, 4 * kConsumers * kPeers);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit and the peers
    }
    if (kCluster > 1) cluster_sync();
    else __syncthreads();
  }

  // The empty barrier (of stage 0) a consumer lane releases (lanes < kPeers): its own CTA's, its B
  // peer's, its A peer's.
  __device__ __forceinline__ uint32_t release_barrier(int lane) const {
    uint32_t release = empty0;
    if (kCluster > 1 && lane < kPeers) {
      const int peer = lane == 0 ? rank : (lane == 1 && CM > 1 ? (1 - cm) + CM * cn : cm + CM * (1 - cn));
      release = peer_addr(empty0, static_cast<uint32_t>(peer));
    }
    return release;
  }

  // Cluster work units this CTA's cluster runs.
  __device__ __forceinline__ int units_mine() const {
    return cluster_units > cluster_id ? (cluster_units - 1 - cluster_id) / clusters + 1 : 0;
  }
};

// The producer warpgroup (after it handed registers to the consumers): lane 0 of its first warp
// issues the TMA loads, its second warp copies the scale words (each its own loop over the same
// stages: 40 registers each); the rest return. Clusters: the CTAs that share B (same columns,
// CM = 2) or A (same rows, CN = 2) each load half of that tile and multicast it to both; this CTA
// is (cm, cn) of its cluster (the caller's reading of its rank, not repeated here).
template <int kConsumers, bool kAlignedScales, int CM, int CN>
__device__ __forceinline__ void run_producer(const GemmParams& p, const CUtensorMap& map_a, const CUtensorMap& map_b,
                                             uint32_t ring, uint32_t* words_g, uint32_t full0, uint32_t empty0,
                                             int cm, int cn, int warp, int lane) {
  using P = PipelinePlan<kConsumers>;
  constexpr int kCluster = CM * CN;
  const int tiles_m = (p.m + P::kBlockM - 1) / P::kBlockM, tiles_n = (p.n + kBlockN - 1) / kBlockN;
  const int cluster_units = ((tiles_m + CM - 1) / CM) * ((tiles_n + CN - 1) / CN) * p.splits;
  const int cluster_id = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  const int nb_total = (p.n + 31) / 32;
  const int kps = p.k_iters_per_split;  // every unit has this many stages (the host checks)
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
        copy_stage_scales<P::kBlockM, kAlignedScales>(p, words, w.m0, w.n0, ka0, kb, nb_total, lane);
        if (kAlignedScales) cp_async_arrive(bar);  // when this lane's copies land
        else mbar_arrive(bar);                     // its plain stores are ordered by the release
      }
    }
  }
}

// Launches `Kernel` (a kernel of PipelinePlan<kConsumers>'s shape in clusters of CM x CN CTAs)
// persistently: as many clusters as can be resident at once, at most one per work unit. Returns a
// cudaError_t, -2 when the driver refuses a tensor map, -3 when no cluster of that shape fits.
template <auto Kernel, int kConsumers, int CM, int CN>
int launch_pipelined(const GemmParams* p, const void* a, long long lda, long long a_cols, const void* b, long long ldb,
                     cudaStream_t stream) {
  using P = PipelinePlan<kConsumers>;
  constexpr int kCluster = CM * CN;
  static bool configured = false;
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, P::kSmemBytes);
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
      err = cudaOccupancyMaxActiveClusters(&resident[device], Kernel, &cfg);
      if (err != cudaSuccess) return static_cast<int>(err);
      if (resident[device] <= 0) return -3;
    }
    clusters = resident[device] < clusters ? resident[device] : clusters;
  }
  const long long tiles_m = (p->m + P::kBlockM - 1) / P::kBlockM, tiles_n = (p->n + kBlockN - 1) / kBlockN;
  const long long units = ((tiles_m + CM - 1) / CM) * ((tiles_n + CN - 1) / CN) * p->splits;
  cfg.gridDim = dim3(static_cast<unsigned>((units < clusters ? units : clusters) * kCluster));
  return static_cast<int>(cudaLaunchKernelEx(&cfg, Kernel, *p, map_a, map_b));
}

}  // namespace
