// What the two MXFP8 GEMM kernels for Hopper share (kernels/csrc/mxfp8_gemm_sm90a.cu, the first
// version, and kernels/csrc/mxfp8_gemm_v2_sm90a.cu): the launch parameters, the tile constants,
// the FP8 wgmma of one 32-wide K slice, the stage's scale words, the epilogues and the operand
// tensor maps. The contract is kernels/mxfp8_gemm.py::mxfp8_gemm_reference.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: the driver is reached through the runtime
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mxfp8_rounding.cuh"
#include "sm90_async.cuh"

// Mirrored by ``_GemmParams`` in kernels/mxfp8_gemm_cuda.py (same order and types).
struct GemmParams {
  const uint8_t* sa;     // activation scales [M, groups * K/32] bytes
  const uint8_t* sb;     // weight scales [ceil(N/32), K/32] bytes
  void* out;             // [M, N] bf16 / fp32, [splits, M, N] fp32 partials, or e4m3 bytes
  uint8_t* out_scales;   // [M, N/32] UE8M0 bytes (MODE_QUANT)
  long long ldsa, ldsb;  // row strides of the scales (bytes)
  long long ldc, ldsc;   // row strides of out (elements) and out_scales (bytes)
  long long split_stride;  // elements between split-K partials
  int m, n, k_group, n_group;  // K per group; output columns per group (n when groups == 1)
  int mode;              // 0 bf16, 1 fp32, 2 fp32 split-K partial, 3 MXFP8
  int splits;            // splits of K (work units = tiles x splits)
  int k_iters_per_split;  // 128-wide K stages per split
  int scales_u32;        // scale rows 4-byte aligned with K a multiple of 128: one word per stage
};

namespace {

constexpr int kBlockN = 128;
constexpr int kBlockK = 128;             // bytes of K per stage (four 32-wide slices)
constexpr int kRowsPerConsumer = 64;     // one warpgroup's wgmma M
constexpr int kGroupM = 8;               // output-tile rasterization (L2 reuse of B)
enum { MODE_BF16 = 0, MODE_FP32 = 1, MODE_SPLIT = 2, MODE_QUANT = 3 };

// A CTA's tile geometry with kConsumers consumer warpgroups: a 64-row A block per consumer, one
// stage = A's rows then B's 128 rows of kBlockK bytes, plus the producer warpgroup's threads.
template <int kConsumers>
struct TileGeometry {
  static constexpr int kBlockM = kRowsPerConsumer * kConsumers;
  static constexpr int kABytes = kBlockM * kBlockK;
  static constexpr int kBBytes = kBlockN * kBlockK;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kThreads = 128 * (kConsumers + 1);  // + the producer warpgroup
  // per stage: one scale word per row of A, then one per 32-column block of B
  static constexpr int kScaleWords = kBlockM + kBlockN / 32;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 4-byte global -> shared copy; src_bytes = 0 zero-fills.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// One arrival on `bar` once this thread's earlier cp.asyncs have landed (counted in the init).
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// D[64 x 128] (+)= A[64 x 32] . B[128 x 32]^T (scale-d from `accumulate`), e4m3 operands from shared
// memory, fp32 (64 per thread).
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

// D[64 x 128] = A[64 x 32] . B[128 x 32]^T: the product overwrites D (scale-d 0).
__device__ __forceinline__ void wgmma_m64n128k32_set(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  wgmma_m64n128k32_acc(d, desc_a, desc_b, 0);
}

// The four slice bytes of a stage as one word (little-endian: slice j in bits 8j..8j+7), read
// byte by byte; slices past `valid` bytes of the row are 0 (their products are zero-filled).
__device__ __forceinline__ uint32_t scale_word_bytes(const uint8_t* row, int valid) {
  uint32_t w = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (j < valid) w |= static_cast<uint32_t>(row[j]) << (8 * j);
  return w;
}

// A producer lane's share of one stage's scale words (`words`: one per row of the tile's A rows
// m0.., then one per 32-column block of B from n0; rows and blocks past the operands read 0):
// with aligned scale rows by 4-byte cp.async (the caller arrives on the stage's barrier when they
// land), else byte by byte for a K tail (plain stores, ordered by the caller's arrival).
template <int kBlockM, bool kAlignedScales>
__device__ __forceinline__ void copy_stage_scales(const GemmParams& p, uint32_t* words, int m0, int n0, int ka0, int kb,
                                                  int nb_total, int lane) {
  if (kAlignedScales) {
#pragma unroll
    for (int i = 0; i < kBlockM / 32; ++i) {
      const int row = m0 + lane + 32 * i;
      const uint8_t* src = p.sa + (row < p.m ? row * p.ldsa + ka0 / 32 + kb : 0);
      cp_async_4(smem_u32(words + lane + 32 * i), src, row < p.m ? 4 : 0);
    }
    if (lane < kBlockN / 32) {
      const int nb = n0 / 32 + lane;
      const uint8_t* src = p.sb + (nb < nb_total ? nb * p.ldsb + kb : 0);
      cp_async_4(smem_u32(words + kBlockM + lane), src, nb < nb_total ? 4 : 0);
    }
  } else {
    const int valid = p.k_group / 32 - kb;
    for (int i = 0; i < kBlockM / 32; ++i) {
      const int row = m0 + lane + 32 * i;
      words[lane + 32 * i] = row < p.m ? scale_word_bytes(p.sa + row * p.ldsa + ka0 / 32 + kb, valid) : 0u;
    }
    if (lane < kBlockN / 32) {
      const int nb = n0 / 32 + lane;
      words[kBlockM + lane] = nb < nb_total ? scale_word_bytes(p.sb + nb * p.ldsb + kb, valid) : 0u;
    }
  }
}

// The bf16 output of a consumer thread's tile accumulators (epilogue's MODE_BF16 alone: few live
// registers, for a kernel that keeps wgmmas in flight meanwhile).
__device__ __forceinline__ void epilogue_bf16(const GemmParams& p, const float (&acc)[64], int r0, int n0, int t) {
  const int col0 = n0 + 2 * (t % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r0 + 8 * r;
    if (row >= p.m) continue;
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + static_cast<long long>(row) * p.ldc + col0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (col0 + 8 * i >= p.n) continue;  // n is even: both columns or neither
      *reinterpret_cast<__nv_bfloat162*>(out + 8 * i) = __floats2bfloat162_rn(acc[4 * i + 2 * r], acc[4 * i + 2 * r + 1]);
    }
  }
}

// Writes a consumer thread's tile accumulators: 4i + 2r + e is (row r0 + 8r, column
// n0 + 8i + 2(t % 4) + e), t the thread's index in its warpgroup.
__device__ __forceinline__ void epilogue(const GemmParams& p, float (&acc)[64], int r0, int n0, int split, int t) {
  const int col0 = n0 + 2 * (t % 4);
  if (p.mode == MODE_QUANT) {  // n and n0 are multiples of 32 here
    uint8_t* q = static_cast<uint8_t*>(p.out);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r0 + 8 * r;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float amax = 0.f;
#pragma unroll
        for (int i = 4 * c; i < 4 * c + 4; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            acc[4 * i + 2 * r + e] = round_to_bf16(acc[4 * i + 2 * r + e]);
            amax = fmaxf(amax, fabsf(acc[4 * i + 2 * r + e]));
          }
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
        const uint32_t byte = ue8m0_byte(amax);
        const float inv = pow2_from_byte(254u - byte);
        if (row >= p.m || n0 + 32 * c >= p.n) continue;
#pragma unroll
        for (int i = 4 * c; i < 4 * c + 4; ++i) {
          const uint32_t lo = quantize_e4m3(acc[4 * i + 2 * r], inv), hi = quantize_e4m3(acc[4 * i + 2 * r + 1], inv);
          *reinterpret_cast<uint16_t*>(q + row * p.ldc + col0 + 8 * i) = static_cast<uint16_t>(lo | (hi << 8));
        }
        if (t % 4 == 0) p.out_scales[row * p.ldsc + n0 / 32 + c] = static_cast<uint8_t>(byte);
      }
    }
    return;
  }
  const long long base = p.mode == MODE_SPLIT ? split * p.split_stride : 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r0 + 8 * r;
    if (row >= p.m) continue;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int col = col0 + 8 * i;
      if (col >= p.n) continue;  // n is even: both columns or neither
      const float v0 = acc[4 * i + 2 * r], v1 = acc[4 * i + 2 * r + 1];
      const long long off = base + row * p.ldc + col;
      if (p.mode == MODE_BF16)
        *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.out) + off) = __floats2bfloat162_rn(v0, v1);
      else
        *reinterpret_cast<float2*>(static_cast<float*>(p.out) + off) = make_float2(v0, v1);
    }
  }
}

// A [rows, cols] byte matrix (row stride `ld`) read as 128-byte x `box_rows` boxes, written to
// shared memory with the 128-byte swizzle; out-of-bounds bytes are zeros.
bool encode_operand_map(CUtensorMap* map, const void* base, long long rows, long long cols, long long ld, int box_rows) {
  const EncodeTiledFn encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld)};
  const cuuint32_t box[2] = {kBlockK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace
