// DeepSeek-V4 sparse decode for up to 32 heads per GPU (TP8 of V4, MTP drafts): memory-bound, so
// no padding to wgmma's 64 rows. Same contract and producer as v4_sparse_decode_sm90a.cu (the
// records of a tile gathered by cp.async and dequantized once into fp16 shared memory); the
// Python side is kernels/v4_sparse_decode_cuda.py, the budget in benchmarks/KERNEL_NOTES.md.
//
// - A CTA = one query token x all its heads (16 or 32 rows: one or two m16 row blocks; 8 heads
//   pad to 16) x one split of the token's 32-record tiles; the grid's splits fill the SMs.
// - Warpgroup 0 produces (v4_sparse_decode_common.cuh); warpgroup 1's four warps each own 128
//   output dims (16 x 128 fp32 = 64 accumulators per row block and thread) and run mma.sync
//   m16n8k16 in fp16 with ldmatrix fragments from the swizzled tiles: partial scores over their
//   128 dims, summed across the four warps through shared memory in one fixed order (every warp
//   holds bit-identical scores), fp32 online softmax, P from the score registers as the A
//   operand of P.V, V by ldmatrix.trans of the same fp16 tile.
// - Split-KV partials and the combine as in the 64-head kernel. Launch shape from tensor shapes.

#include "v4_sparse_decode_common.cuh"

namespace {

constexpr int kNarrowThreads = 256;  // producer + one consumer warpgroup
constexpr int kBarSumsWritten = 3, kBarSumsRead = 4;  // named barriers of the consumer warpgroup

template <int kRowBlocks>
struct NarrowPlan {
  static constexpr int kRows = 16 * kRowBlocks;
  static constexpr int kQBox = kRows * 128;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + 8 * kQBox;
  static constexpr int kRaw = kK + kKStages * kKBytes;
  static constexpr int kXchg = kRaw + kRawStages * kRawBytes;  // 4 warps x row blocks x 16 x 32 floats
  static constexpr int kBias = kXchg + kXchgBytes;
  static constexpr int kBars = kBias + kKStages * kRec * 4;
  static constexpr int kBytes = kBars + 2 * kKStages * 8 + 1024;
  static_assert(4 * kRowBlocks * 16 * kRec * 4 <= kXchgBytes, "partial scores do not fit");
};

template <int kRowBlocks>
__global__ void __launch_bounds__(kNarrowThreads, 1) v4_sparse_decode_narrow_kernel(const __grid_constant__ SparseParams p) {
  using Plan = NarrowPlan<kRowBlocks>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* q_s = smem + Plan::kQ;
  uint8_t* k_s = smem + Plan::kK;
  float* xchg = reinterpret_cast<float*>(smem + Plan::kXchg);
  float* bias_s = reinterpret_cast<float*>(smem + Plan::kBias);
  const uint32_t bar_full = smem_addr(smem + Plan::kBars), bar_empty = bar_full + 8 * kKStages;

  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int bt = blockIdx.y, split = blockIdx.z;
  const int b = bt / p.s_q, tq = bt % p.s_q;
  const CtaTiles tiles(p, split);
  const int n = tiles.n;
  load_q_tile<Plan::kRows>(p, b, tq, 0, q_s, tid, kNarrowThreads);
  if (tid == 0) {
    for (int s = 0; s < kKStages; ++s) {
      mbar_init_count(bar_full + 8 * s, 128);
      mbar_init_count(bar_empty + 8 * s, 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  fence_async_shared();
  __syncthreads();
  if (wg == 0) {
    produce_tiles(p, tiles, b, tq, tid, smem + Plan::kRaw, k_s, bias_s, bar_full, bar_empty);
    return;
  }

  // ---- consumer warp w: output dims 128w..128w+127 (boxes 2w, 2w + 1) ------------------------
  const int w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, q4 = lane & 3;
  const int mi = lane >> 3, ri = lane & 7;  // ldmatrix: this lane's matrix and row address
  const uint32_t q_base = smem_addr(q_s), k_base = smem_addr(k_s);
  float o[kRowBlocks][16][4];
#pragma unroll
  for (int rb = 0; rb < kRowBlocks; ++rb)
#pragma unroll
    for (int dt = 0; dt < 16; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[rb][dt][e] = 0.f;
  float m_run[kRowBlocks][2], l_run[kRowBlocks][2];
#pragma unroll
  for (int rb = 0; rb < kRowBlocks; ++rb)
#pragma unroll
    for (int i = 0; i < 2; ++i) m_run[rb][i] = -INFINITY, l_run[rb][i] = 0.f;

  for (int t = 0; t < n; ++t) {
    const int ks = t % kKStages;
    mbar_wait(bar_full + 8 * ks, (t / kKStages) & 1);
    const uint32_t kt = k_base + ks * kKBytes;
    // Partial S[rows][records 8nt + 2q4 + e] over this warp's 128 dims.
    float s[kRowBlocks][4][4];
#pragma unroll
    for (int rb = 0; rb < kRowBlocks; ++rb)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[rb][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {  // dims 128w + 16kk: box 2w + kk / 4, chunks ch0, ch0 + 1
      const int box = 2 * w + (kk >> 2), ch0 = 2 * (kk & 3);
      uint32_t bk[4][2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // record tiles 2half, 2half + 1
        uint32_t r[4];
        ldmatrix_x4(kt + box * kKBox + swizzled(8 * (2 * half + (mi >> 1)) + ri, ch0 + (mi & 1)), r);
        bk[2 * half][0] = r[0], bk[2 * half][1] = r[1], bk[2 * half + 1][0] = r[2], bk[2 * half + 1][1] = r[3];
      }
#pragma unroll
      for (int rb = 0; rb < kRowBlocks; ++rb) {
        uint32_t a[4];
        ldmatrix_x4(q_base + box * Plan::kQBox + swizzled(16 * rb + ri + 8 * (mi & 1), ch0 + (mi >> 1)), a);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) mma_16816(s[rb][nt], a, bk[nt][0], bk[nt][1]);
      }
    }
    // The four warps' partials, summed in warp order by every warp (bit-identical scores).
#pragma unroll
    for (int rb = 0; rb < kRowBlocks; ++rb)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
        *reinterpret_cast<float4*>(xchg + (((w * kRowBlocks + rb) * 4 + nt) * 32 + lane) * 4) =
            make_float4(s[rb][nt][0], s[rb][nt][1], s[rb][nt][2], s[rb][nt][3]);
    named_barrier_sync(kBarSumsWritten, 128);
#pragma unroll
    for (int rb = 0; rb < kRowBlocks; ++rb)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        float4 acc = *reinterpret_cast<const float4*>(xchg + ((rb * 4 + nt) * 32 + lane) * 4);
#pragma unroll
        for (int ww = 1; ww < 4; ++ww) {
          const float4 x = *reinterpret_cast<const float4*>(xchg + (((ww * kRowBlocks + rb) * 4 + nt) * 32 + lane) * 4);
          acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
        }
        s[rb][nt][0] = acc.x, s[rb][nt][1] = acc.y, s[rb][nt][2] = acc.z, s[rb][nt][3] = acc.w;
      }
    named_barrier_sync(kBarSumsRead, 128);

    // Online softmax in log2 units (rows 16rb + g + 8i: s[rb][nt][2i + e]).
    const float* bias = bias_s + ks * kRec;
    uint32_t pa[kRowBlocks][2][4];
#pragma unroll
    for (int rb = 0; rb < kRowBlocks; ++rb) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float2 bb = *reinterpret_cast<const float2*>(bias + 8 * nt + 2 * q4);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          s[rb][nt][2 * i] = fmaf(s[rb][nt][2 * i], p.scale_log2, bb.x);
          s[rb][nt][2 * i + 1] = fmaf(s[rb][nt][2 * i + 1], p.scale_log2, bb.y);
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) mx = fmaxf(mx, fmaxf(s[rb][nt][2 * i], s[rb][nt][2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[rb][i], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2f(m_run[rb][i] - m_use);
        m_run[rb][i] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          s[rb][nt][2 * i] = exp2f(s[rb][nt][2 * i] - m_use);
          s[rb][nt][2 * i + 1] = exp2f(s[rb][nt][2 * i + 1] - m_use);
          sum += s[rb][nt][2 * i] + s[rb][nt][2 * i + 1];
        }
        l_run[rb][i] = l_run[rb][i] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < 16; ++dt) o[rb][dt][2 * i] *= alpha, o[rb][dt][2 * i + 1] *= alpha;
      }
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {  // P's A fragments: records 16kk.. = score tiles 2kk, 2kk + 1
        pa[rb][kk][0] = pack_half2(s[rb][2 * kk][0], s[rb][2 * kk][1]);
        pa[rb][kk][1] = pack_half2(s[rb][2 * kk][2], s[rb][2 * kk][3]);
        pa[rb][kk][2] = pack_half2(s[rb][2 * kk + 1][0], s[rb][2 * kk + 1][1]);
        pa[rb][kk][3] = pack_half2(s[rb][2 * kk + 1][2], s[rb][2 * kk + 1][3]);
      }
    }
    // O[rows][dims 128w + 8dt + 2q4 + e] += P . V, V fragments by ldmatrix.trans of record rows.
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int dp = 0; dp < 8; ++dp) {  // dim tiles 2dp, 2dp + 1
        const int dt = 2 * dp + (mi >> 1);
        uint32_t r[4];
        ldmatrix_x4_trans(kt + (2 * w + (dt >> 3)) * kKBox + swizzled(16 * kk + 8 * (mi & 1) + ri, dt & 7), r);
#pragma unroll
        for (int rb = 0; rb < kRowBlocks; ++rb) {
          mma_16816(o[rb][2 * dp], pa[rb][kk], r[0], r[1]);
          mma_16816(o[rb][2 * dp + 1], pa[rb][kk], r[2], r[3]);
        }
      }
    mbar_arrive(bar_empty + 8 * ks);
  }

  // ---- epilogue ---------------------------------------------------------------------------------
  const bool split_kv = p.num_splits > 1;
#pragma unroll
  for (int rb = 0; rb < kRowBlocks; ++rb)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float l = l_run[rb][i];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int head = 16 * rb + g + 8 * i;
      if (head >= p.heads) continue;
      const bool lonely = !(l > 0.f);
      const float lse = lonely ? -INFINITY : (m_run[rb][i] + log2f(l)) * kLn2;
      float factor = lonely ? 0.f : 1.f / l;
      if (!split_kv && p.sinks != nullptr && !lonely) factor /= 1.f + expf(p.sinks[head] - lse);
      if (split_kv) {
        const long long flat = static_cast<long long>(bt) * p.num_splits + split;
        float* dst = p.part_o + (flat * p.heads + head) * kDim + 128 * w + 2 * q4;
#pragma unroll
        for (int dt = 0; dt < 16; ++dt)
          *reinterpret_cast<float2*>(dst + 8 * dt) = make_float2(o[rb][dt][2 * i] * factor, o[rb][dt][2 * i + 1] * factor);
        if (w == 0 && q4 == 0) p.part_l[flat * p.heads + head] = lse;
      } else {
        __nv_bfloat16* dst = p.out + b * p.o_sb + tq * p.o_ss + head * p.o_sh + 128 * w + 2 * q4;
#pragma unroll
        for (int dt = 0; dt < 16; ++dt)
          *reinterpret_cast<__nv_bfloat162*>(dst + 8 * dt) =
              __floats2bfloat162_rn(o[rb][dt][2 * i] * factor, o[rb][dt][2 * i + 1] * factor);
        if (w == 0 && q4 == 0) p.lse[b * p.l_sb + tq * p.l_ss + head * p.l_sh] = lonely ? INFINITY : lse;
      }
    }
}

template <int kRowBlocks>
int launch_narrow(const SparseParams* p, cudaStream_t stream) {
  static bool configured = false;
  constexpr int bytes = NarrowPlan<kRowBlocks>::kBytes;
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(v4_sparse_decode_narrow_kernel<kRowBlocks>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  const dim3 grid(1, p->batch * p->s_q, p->num_splits);
  v4_sparse_decode_narrow_kernel<kRowBlocks><<<grid, kNarrowThreads, bytes, stream>>>(*p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// Up to 32 heads. Returns a cudaError_t (0 = success), or -1 for more heads.
int v4_sparse_decode_narrow_sm90(const SparseParams* p, void* stream) {
  if (p->heads <= 16) return launch_narrow<1>(p, static_cast<cudaStream_t>(stream));
  if (p->heads <= 32) return launch_narrow<2>(p, static_cast<cudaStream_t>(stream));
  return -1;
}

int v4_sparse_decode_narrow_sm90_smem_bytes(int heads) {
  return heads <= 16 ? NarrowPlan<1>::kBytes : (heads <= 32 ? NarrowPlan<2>::kBytes : -1);
}

}  // extern "C"
