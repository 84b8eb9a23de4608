// The MXFP8 rounding rules of kernels/mxfp8_quant_triton.py on the integer bits (bf16 round to
// nearest even, the UE8M0 byte of a block's amax, e4m3 round to nearest even with saturation),
// for the CUDA GEMM's quantizing epilogue. Host and device: a CPU test runs them on the host
// against kernels/microscaling.py's quantize_mxfp8, byte for byte.
#pragma once

#include <stdint.h>
#include <string.h>

namespace {

__host__ __device__ __forceinline__ uint32_t float_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, 4);
  return b;
}
__host__ __device__ __forceinline__ float bits_float(uint32_t b) {
  float x;
  memcpy(&x, &b, 4);
  return x;
}
// a * b rounded once (never contracted into an FMA)
__host__ __device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// fp32 2^(byte - 127) from the bits (byte 0 gives 0.0, as the Triton kernels' pow2_from_byte).
__host__ __device__ __forceinline__ float pow2_from_byte(uint32_t byte) { return bits_float(byte << 23); }

__host__ __device__ __forceinline__ float round_to_bf16(float x) {
  uint32_t b = float_bits(x);
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  return bits_float(b);
}
// UE8M0 byte of 2^ceil(log2(max(amax, 1e-4) / 448)), amax >= 0.
__host__ __device__ __forceinline__ uint32_t ue8m0_byte(float amax) {
  const uint32_t bits = float_bits(mul_rn(amax > 1e-4f ? amax : 1e-4f, 0.002232142857142857f));
  return ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0u);
}
// e4m3 byte of fp32 y (|y| <= 448), round to nearest even.
__host__ __device__ __forceinline__ uint32_t e4m3_rne_bits(float y) {
  const uint32_t bits = float_bits(y);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const int mag = static_cast<int>(bits & 0x7FFFFFFFu);
  const int normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3);
  int shift = 141 - (mag >> 23);
  shift = shift > 31 ? 31 : (shift < 1 ? 1 : shift);  // >= 21 where `sub` is taken (clamped: no UB)
  const int full = (mag & 0x7FFFFF) | 0x800000;
  const int sub = (full + (1 << (shift - 1)) - 1 + ((full >> shift) & 1)) >> shift;
  return static_cast<uint32_t>(mag >= (121 << 23) ? normal : sub) | sign;
}
// e4m3 byte of z / 2^e given inv_scale = 2^-e, saturated to +-448.
__host__ __device__ __forceinline__ uint32_t quantize_e4m3(float z, float inv_scale) {
  float y = mul_rn(z, inv_scale);
  y = y < -448.f ? -448.f : (y > 448.f ? 448.f : y);
  return e4m3_rne_bits(y);
}

}  // namespace
