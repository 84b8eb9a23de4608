// Split-KV combine of the paged MLA decode kernels in this directory: merges the normalized
// partial outputs (bf16) and LSEs (fp32) that the splits of a request wrote (Params::part_o,
// part_l) into out [B, s_q, H, 512] (bf16, times out_scale) and lse [B, s_q, H].
//
// Why a kernel of its own, launched with programmatic dependent launch (PDL):
// - Small batches split each request's tiles over many CTAs, so the merge reads up to 128
//   partials per row; a warp takes a quarter (128 dims) of one row, so even B = 1 gives
//   4 x rows warps, and a lane loads its four dims of 32 splits at once (8-byte loads).
// - bf16 partials halve the bytes the splits write and this kernel reads back (through L2) at
//   the small batches that split most; the weights and the sum stay fp32, so the merge adds one
//   bf16 rounding of each partial (2^-9 relative) to the output's own.
// - The decode kernels trigger their dependents as they start (griddepcontrol.launch_dependents),
//   so this grid is launched while they run and its CTAs wait in griddepcontrol.wait (which
//   returns once the decode grid has finished and its writes are visible): the launch latency
//   and this kernel's start hide under the decode. Captured in a CUDA graph as a programmatic
//   edge. Without the attribute griddepcontrol.wait is a no-op and the stream orders them.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "mla_decode_common.cuh"

namespace {

constexpr int kWarpsPerCta = 4;
constexpr int kQuarters = 4;                 // a warp merges 128 of a row's 512 dims: 4 per lane
constexpr int kMaxSplits = 32 * 4;           // four LSEs per lane
constexpr int kDim = 512;

__global__ void __launch_bounds__(32 * kWarpsPerCta) mla_decode_combine_kernel(const Params p) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the decode grid's partials
  const int lane = threadIdx.x & 31;
  const long long task = static_cast<long long>(blockIdx.x) * kWarpsPerCta + (threadIdx.x >> 5);
  const int rows_total = p.s_q * p.heads;
  if (task >= static_cast<long long>(p.batch) * rows_total * kQuarters) return;  // warp-uniform
  const long long flat = task / kQuarters;  // b * rows_total + row
  const int quarter = static_cast<int>(task % kQuarters);
  const int ns = p.num_splits;

  // Weights exp(lse_s - m) of the splits, split s on lane s % 32, register s / 32.
  const float* pl = p.part_l + flat * ns;
  float w[4];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int s = lane + 32 * i;
    w[i] = s < ns ? __ldcg(pl + s) : -INFINITY;
    m = fmaxf(m, w[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float m_safe = m == -INFINITY ? 0.f : m;  // every split empty: weights 0
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = expf(w[i] - m_safe);  // exp(-inf) = 0 for empty splits and lanes past ns
    total += w[i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);

  const __nv_bfloat16* po = p.part_o + flat * ns * kDim + quarter * 128 + 4 * lane;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  // 32 splits at a time: all 32 loads issued before the first use, so a row costs one L2 round
  // trip per 32 splits (a split past ns loads nothing and weighs 0).
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (32 * i >= ns) break;
    const __nv_bfloat16* base = po + static_cast<long long>(32 * i) * kDim;
    uint2 raw[32];
#pragma unroll
    for (int k = 0; k < 32; ++k)
      raw[k] = 32 * i + k < ns ? __ldcg(reinterpret_cast<const uint2*>(base + static_cast<long long>(k) * kDim))
                               : make_uint2(0u, 0u);
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const float ws = __shfl_sync(0xffffffffu, w[i], k);
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[k].x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[k].y));
      acc.x = fmaf(ws, lo.x, acc.x);
      acc.y = fmaf(ws, lo.y, acc.y);
      acc.z = fmaf(ws, hi.x, acc.z);
      acc.w = fmaf(ws, hi.y, acc.w);
    }
  }

  const int b = static_cast<int>(flat / rows_total), row = static_cast<int>(flat % rows_total);
  const int j = row / p.heads, h = row % p.heads;
  const float scale = p.out_scale / total;
  const __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x * scale, acc.y * scale);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(acc.z * scale, acc.w * scale);
  uint2 packed;
  packed.x = *reinterpret_cast<const uint32_t*>(&lo);
  packed.y = *reinterpret_cast<const uint32_t*>(&hi);
  __nv_bfloat16* dst = p.out + b * p.o_sb + j * p.o_ss + h * p.o_sh + quarter * 128 + 4 * lane;
  *reinterpret_cast<uint2*>(dst) = packed;
  if (quarter == 0 && lane == 0) p.lse[b * p.l_sb + j * p.l_ss + h * p.l_sh] = m_safe + logf(total);
}

}  // namespace

extern "C" {

// Returns a cudaError_t (0 = success), or -3 for a split count the combine does not take.
// pdl != 0 launches with programmatic stream serialization (the decode kernel before it on the
// stream must be one of this directory's, which trigger their dependents early).
int mla_decode_split_combine_sm90(const Params* p, int pdl, void* stream) {
  if (p->num_splits < 2 || p->num_splits > kMaxSplits) return -3;
  const long long warps = static_cast<long long>(p->batch) * p->s_q * p->heads * kQuarters;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>((warps + kWarpsPerCta - 1) / kWarpsPerCta));
  cfg.blockDim = dim3(32 * kWarpsPerCta);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return static_cast<int>(cudaLaunchKernelEx(&cfg, mla_decode_combine_kernel, *p));
}

int mla_decode_split_combine_max_splits() { return kMaxSplits; }

}  // extern "C"
