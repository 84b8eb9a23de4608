// What the two wgmma MLA decode kernels share (mla_decode_wgmma_sm90a.cu: 64 query rows per CTA,
// mla_decode_wgmma_narrow_sm90a.cu: 16 or 32): the cache tile as TMA writes it, Q's packed
// layout, the FP8 P convention, the V^T register fragments of P.V and the cache's tensor map.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: the driver is reached through the runtime
#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_decode_common.cuh"
#include "sm90_async.cuh"

namespace {

constexpr int kDim = 576;                // latent (512) + rope (64)
constexpr int kDimV = 512;
constexpr int kTile = 64;                // tokens per tile
constexpr int kChunks = kDim / 16;       // 16-byte chunks per row
constexpr float kLn2 = 0.6931471805599453f;
// P = exp2(s - m) <= 2^kRescaleSlack (m moves lazily) is stored as e4m3(2^kLog2PScale P): at
// most 256 (e4m3 tops out at 448), and values down to 2^-12 stay normal numbers.
constexpr float kRescaleSlack = 2.f;
constexpr float kLog2PScale = 6.f;

// Cache tiles, as TMA writes them with the 128-byte swizzle: five boxes of 64 token rows x 128
// bytes (dims 128i..128i+127; the last box's second half is zero), the 16-byte chunk c of token
// t at box + 128 t + 16 (c ^ (t & 7)). Boxes must start on 1024-byte boundaries.
constexpr int kBoxBytes = 128;
constexpr int kBoxes = (kDim + kBoxBytes - 1) / kBoxBytes;  // 5
constexpr int kBoxSize = kTile * kBoxBytes;                // 8192
constexpr int kTileBytes = kBoxes * kBoxSize;              // 40960
// Where a request's tile T lives: block-table entry T / tiles_per_page, token row
// (T % tiles_per_page) * 64 of that page. Pages of 64 tokens (the usual) or of a power of two of
// tiles take a shift and a mask: a division by a run-time value goes through the MUFU pipe, where
// in the 64-row kernel's refill it queued behind the softmax's exponentials (~300 cycles per
// refill). The narrow kernel refills before its exponentials and keeps the plain division
// (measured: 86.2 vs 88.2 us with this at B=128, 16 heads).
struct PagedTiles {
  int tiles, shift;  // tiles per page; its log2, or -1 when it is not a power of two
  __device__ explicit PagedTiles(int page_size) : tiles(page_size / kTile), shift(0) {
    while ((1 << shift) < tiles) ++shift;
    if ((1 << shift) != tiles) shift = -1;
  }
  __device__ int entry(int t) const { return shift >= 0 ? t >> shift : t / tiles; }
  __device__ int row(int t) const { return (shift >= 0 ? t & (tiles - 1) : t % tiles) * kTile; }
};

// Q (never transposed, copied by the threads) is packed into wgmma's no-swizzle K-major layout:
// core matrices of 8 rows x 16 bytes, 128 B apart along K, 4608 B between 8-row groups.
constexpr int kQGroupStride = kChunks * 128;

// Q (rows x 576 bytes, rows strided in memory) is copied as 16-byte chunks; chunk i goes to
// (row group, chunk column, row in group) so that 8 consecutive threads fill one core matrix.
__device__ __forceinline__ int chunk_row(int i) { return (i / (8 * kChunks)) * 8 + (i & 7); }
__device__ __forceinline__ int chunk_col(int i) { return (i % (8 * kChunks)) >> 3; }
__device__ __forceinline__ int chunk_dst(int i) { return (i / (8 * kChunks)) * kQGroupStride + chunk_col(i) * 128 + (i & 7) * 16; }
// Issues the cp.async of chunk i of the CTA's Q rows (rows from row0 of request b; rows past
// the request's rows_total are zero-filled) into the packed Q at q_s.
__device__ __forceinline__ void copy_q_chunk(const Params& p, int b, int row0, int rows_total, uint8_t* q_s, int i) {
  const int row = row0 + chunk_row(i);
  const bool valid = row < rows_total;
  const uint8_t* src = p.q;
  if (valid) src += b * p.q_sb + (row / p.heads) * p.q_ss + (row % p.heads) * p.q_sh + chunk_col(i) * 16;
  cp_async_16(smem_addr(q_s + chunk_dst(i)), src, valid ? 16 : 0);
}

// Fetches the cache's tensor map (a kernel parameter) into the TMA unit's descriptor cache
// while the CTA loads Q and sets up its barriers, so the first tile's copies do not wait for it
// (a short split's time is mostly such first latencies). One thread.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// One cache tile (token row `row` of page `page`, 64 tokens) into the stage at `dst` as five
// boxes, completing mbarrier `bar` with the whole tile's bytes (the out-of-bounds half of the
// fifth box counts too). One thread.
__device__ __forceinline__ void load_tile_boxes(uint32_t dst, uint32_t bar, const CUtensorMap* map, int row, int page) {
  mbar_arm(bar, kTileBytes);
#pragma unroll
  for (int i = 0; i < kBoxes; ++i) tma_load_box(dst + i * kBoxSize, map, i * kBoxBytes, row, page, bar);
}

// P.V runs as O^T += V^T . P^T (M = 64 dims per wgmma, N = the query rows, K = 32 tokens),
// V^T from registers: no transposed copy of V in shared memory. The reduction runs over a
// permutation of the tile's tokens, the same for P's columns (K of the B operand) and for the
// fragments: token 32kk + 16hh + 8a + 2q + e is column 32kk + 16hh + 4q + 2a + e.
__device__ __forceinline__ int p_column(int token) {
  return (token & 48) | (((token >> 1) & 3) << 2) | (((token >> 3) & 1) << 1) | (token & 1);
}

// 4x4 byte transpose: out[m] byte i = byte m of in[i].
__device__ __forceinline__ void transpose4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t (&out)[4]) {
  const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
  const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(ab_lo, cd_lo, 0x5410);
  out[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
  out[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
  out[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

// This thread's A fragments of a tile's O^T += V^T . P^T: va[kk][mb] for k-step kk (P columns
// 32kk..) and m-block mb, whose rows g and g+8 are dims d0 + 2mb and d0 + 2mb + 1 (d0 = 256 x the
// m-blocks' half of the dims + 64warp + 8g: the thread's 8 dims are contiguous bytes of a token
// row). Registers: 0 = (row g,
// columns 4q4..4q4+3), 1 = (row g+8, same), 2 and 3 = the same 16 columns on. 8-byte loads
// (16 lanes read 8 distinct 16-byte slots of the swizzled rows: conflict-free), 4x4 byte
// transposes. Tokens at or past `valid` (slots past the sequence, maybe NaN) become zeros.
__device__ __forceinline__ void load_v_fragments(const uint8_t* tile, int d0, int q4, int valid, uint32_t (&va)[2][4][4]) {
  const int c = d0 >> 4;
  const uint8_t* box = tile + (c >> 3) * kBoxSize + (d0 & 8);
#pragma unroll
  for (int kk = 0; kk < 2; ++kk)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      uint2 x[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int t = 32 * kk + 16 * hh + 8 * (i >> 1) + 2 * q4 + (i & 1);
        x[i] = *reinterpret_cast<const uint2*>(box + t * kBoxBytes + (((c & 7) ^ (t & 7)) << 4));
      }
      if (valid < kTile) {  // the sequence's last tile only (a branch the whole CTA takes alike)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (32 * kk + 16 * hh + 8 * (i >> 1) + 2 * q4 + (i & 1) >= valid) x[i] = make_uint2(0, 0);
      }
#pragma unroll
      for (int wh = 0; wh < 2; ++wh) {  // dims d0 + 4wh .. d0 + 4wh + 3
        uint32_t out[4];
        transpose4x4((&x[0].x)[wh], (&x[1].x)[wh], (&x[2].x)[wh], (&x[3].x)[wh], out);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int ld = 4 * wh + m;  // dim d0 + ld = row (ld & 1 ? g + 8 : g) of m-block ld / 2
          va[kk][ld >> 1][(ld & 1) + 2 * hh] = out[m];
        }
      }
    }
}

// The cache [num_pages, page_size, 576] as a 3-D tensor of bytes (byte, token, page; `row_bytes`
// per token: 576 for e4m3, 1152 for bf16) whose boxes are 128 bytes x one tile of tokens, written
// to shared memory with the 128-byte swizzle.
bool encode_cache_map(CUtensorMap* map, const Params& p, long long num_pages, int row_bytes = kDim) {
  const EncodeTiledFn encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(p.page_size),
                              static_cast<cuuint64_t>(num_pages)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.kv_st), static_cast<cuuint64_t>(p.kv_sp)};
  const cuuint32_t box[3] = {kBoxBytes, kTile, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<uint8_t*>(p.kv), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace
