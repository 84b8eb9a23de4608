// What the V4 sparse decode kernels share (v4_sparse_decode_sm90a.cu and
// v4_sparse_decode_t64_sm90a.cu: 64 heads per CTA on wgmma; v4_sparse_decode_narrow_sm90a.cu and
// v4_sparse_decode_tokens_sm90a.cu: up to 32 / 16 heads): the launch parameters, the fp16 tile
// layout, the dequantization of MODEL1 records and of V4.1's window rows and entries, the record
// lookup and loads of the kernels that gather into registers, the m64n256 output rows, and v1's
// 32-record producer warpgroup.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "mla_decode_common.cuh"
#include "sm90_async.cuh"

// Mirrored by kernels/v4_sparse_decode_cuda.py (same order and types).
struct SparseScope {
  // MODEL1 pages: page_size 576-byte data rows, then 8-byte scale rows; V4.1 pages: page_size
  // whole records (values, then scales) of 528 (window) or 288 (entry) bytes. The record format
  // is a template argument of the v2 kernels (kFmt*), not a field.
  const uint8_t* cache;
  long long page_stride;  // bytes, a multiple of 8 (16: MODEL1 pages; 584: V4 one-record rows)
  const int* indices;     // [B, s_q, k]: page * page_size + slot, -1 = none
  long long idx_sb, idx_ss;
  const int* lengths;     // [B] or null: only indices[b, :, :lengths[b]] count
  int page_size, k, tiles;
};

struct SparseParams {
  const __nv_bfloat16* q;  // [B, s_q, H, 512]
  long long q_sb, q_ss, q_sh;
  SparseScope scope[2];
  const float* sinks;      // [H] or null
  __nv_bfloat16* out;      // [B, s_q, H, 512] when num_splits == 1
  long long o_sb, o_ss, o_sh;
  float* lse;              // [B, s_q, H] when num_splits == 1
  long long l_sb, l_ss, l_sh;
  float* part_o;           // [B * s_q * num_splits, H, 512] when num_splits > 1
  float* part_l;           // [B * s_q * num_splits, H]
  int num_scopes, batch, s_q, heads, num_splits, tiles_per_split;
  float scale_log2;        // softmax_scale * log2(e)
  // V's N-major descriptor: bytes between 64-dim boxes (leading) and between 8-record groups
  // (stride); 4096 and 1024 (a parameter so that a device check can tell a swapped pair).
  uint32_t v_desc_lead, v_desc_stride;
};

namespace {

constexpr int kRec = 32;      // records per tile
constexpr int kDim = 512;
constexpr int kKStages = 2;   // fp16 tiles
constexpr int kRawStages = 4;  // raw tiles in flight
constexpr int kDataBytes = 576;  // 448 e4m3 + 64 bf16
constexpr int kE4m3Chunks = 28;  // 16-byte chunks of e4m3 per record
constexpr int kChunks = 36;      // 16-byte chunks of a record's data row
constexpr float kLn2 = 0.6931471805599453f;

// fp16 tiles in shared memory (Q and each K stage): eight boxes of 64 dims (128-byte rows, one
// per head or record), 16-byte chunk j of row r at box + 128 r + 16 (j ^ (r & 7)): wgmma's
// 128-byte swizzle (read K-major for Q.K^T and N-major for P.V), and conflict-free rows for
// ldmatrix. Boxes start on 1024 bytes.
constexpr int kKBox = kRec * 128;            // 4096
constexpr int kKBytes = 8 * kKBox;           // 32768
// A raw stage: the tile's data rows, then each producer thread's copy of its record's scales.
constexpr int kRawData = kRec * kDataBytes;  // 18432
constexpr int kRawBytes = kRawData + kRec * 4 * 8;
constexpr int kXchgBytes = 2 * 16 * 128 * 4;  // the consumers' partial scores (both kernels)

__device__ __forceinline__ int swizzled(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// 16 e4m3 values (a 16-byte raw chunk) times 2^(e - 127) as 16 fp16 values: one cvt per pair
// and one packed multiply by the power-of-two scale.
__device__ __forceinline__ void dequant_e4m3x16(uint4 x, uint32_t e, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  const __half s = __float2half_rn(__uint_as_float(e << 23));
  const __half2 s2 = __halves2half2(s, s);
  uint32_t h[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[k] & 0xFFFF), __NV_E4M3);
    const __half2_raw c = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[k] >> 16), __NV_E4M3);
    const __half2 a2 = __hmul2(__half2(a), s2), c2 = __hmul2(__half2(c), s2);
    h[2 * k] = *reinterpret_cast<const uint32_t*>(&a2);
    h[2 * k + 1] = *reinterpret_cast<const uint32_t*>(&c2);
  }
  lo = make_uint4(h[0], h[1], h[2], h[3]);
  hi = make_uint4(h[4], h[5], h[6], h[7]);
}

// bf16 pairs as fp16 pairs (RoPE dims and q): one value pair, or the 8 values of 16 bytes.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t w) {
  const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&w);
  return pack_half2(__low2float(b), __high2float(b));
}
__device__ __forceinline__ uint4 bf16x8_to_f16(uint4 x) {
  return make_uint4(bf16x2_to_f16x2(x.x), bf16x2_to_f16x2(x.y), bf16x2_to_f16x2(x.z), bf16x2_to_f16x2(x.w));
}

// The UE8M0 exponent of 64-dim block `blk` (< 7) from a record's 8 scale bytes.
__device__ __forceinline__ uint32_t scale_exponent(uint32_t lo, uint32_t hi, int blk) {
  return (blk < 4 ? lo >> (8 * blk) : hi >> (8 * (blk - 4))) & 0xFF;
}

// ---- V4.1 records (kernels/v4_cache_formats.py), read by the v2 kernels -----------------------
// Record formats, a template argument per scope (mirrored by FORMAT_CODES in
// kernels/v4_sparse_decode_cuda.py): V4's MODEL1 record, V4.1's window row (512 e4m3, then 16
// UE8M0 bytes, one per 32 dims), V4.1's compressed entry (512 e2m1 in pairs, even index in the low
// nibble, then 32 e4m3 scales, one per 16 dims).
constexpr int kFmtV4 = 0, kFmtWindow = 1, kFmtEntry = 2;
__host__ __device__ constexpr int v41_record_bytes(int f) { return f == kFmtWindow ? 528 : 288; }
__host__ __device__ constexpr int v41_value_bytes(int f) { return f == kFmtWindow ? 512 : 256; }

// An entry tile holds K * 2^-kEntryShift in fp16, which makes every e2m1 value times its e4m3 scale
// exact there (at most 6 * 448 * 2^-7 = 21, bits down to 2^-1 * 2^-9 * 2^-7 = 2^-17; at K's own
// scale, 2^14 * value * scale would not fit): its consumers scale the scores by 2^7 and P by 2^7
// (P <= 2^8 by the lazy maximum, so P * 2^7 <= 2^15 fits fp16 too), and the row sums, taken from
// that P, by 2^-7.
constexpr float kEntryShift = 7.f;
constexpr float kEntryScoreScale = 128.f, kEntrySumScale = 1.f / 128.f;

// (x & 0x80808080) | (y & 0x7F7F7F7F) in one LOP3 (the compiler splits it in two).
__device__ __forceinline__ uint32_t sign_bits_from(uint32_t x, uint32_t y) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xCA;\n" : "=r"(d) : "n"(0x80808080u), "r"(x), "r"(y));
  return d;
}
// 8 e2m1 codes (a word, code 2k in the low nibble of byte k) as 4 fp16 pairs in natural order, each
// value times 2^-14: the code's sign, exponent and mantissa bits placed at fp16's bits 15, 10-11 and
// 9 (exact, the subnormal code 0.5 included). Bytes a / b hold each pair's even / odd code at bit 7
// (sign) and bits 1-3 (magnitude); the permute puts them in the high bytes of the two halves. 13
// integer ops per 8 codes, no conversion unit, no branch.
__device__ __forceinline__ void e2m1x8_to_f16_biased(uint32_t w, uint32_t (&h)[4]) {
  const uint32_t a = sign_bits_from(w << 4, w << 1), b = sign_bits_from(w, w >> 3);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __byte_perm(a, b, k | (k << 4) | (k << 8) | ((4 + k) << 12)) & 0x8E008E00u;
}

// Two e4m3 scale bytes (the low 16 bits) as an fp16 pair times 2^7 (exact: at most 448 * 128).
__device__ __forceinline__ __half2 e4m3x2_scale_x128(uint32_t pair) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFF), __NV_E4M3);
  return __hmul2(__half2(r), __float2half2_rn(128.f));
}

// 16 e2m1 codes (8 bytes) of one 16-dim block times its scale (s2: the e4m3 scale * 2^7 in both
// halves) as 16 fp16 values of K * 2^-kEntryShift, in natural order.
__device__ __forceinline__ void dequant_e2m1x16(uint32_t w0, uint32_t w1, __half2 s2, uint4& lo, uint4& hi) {
  uint32_t h[8];
  e2m1x8_to_f16_biased(w0, *reinterpret_cast<uint32_t(*)[4]>(h));
  e2m1x8_to_f16_biased(w1, *reinterpret_cast<uint32_t(*)[4]>(h + 4));
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&h[k]), s2);
    h[k] = *reinterpret_cast<const uint32_t*>(&v);
  }
  lo = make_uint4(h[0], h[1], h[2], h[3]);
  hi = make_uint4(h[4], h[5], h[6], h[7]);
}

// Dequantize one 16-byte raw chunk c (< 36) of a record into the fp16 K stage at `kt`, row r:
// chunks below 28 are 16 e4m3 values (dims 16c..) times 2^(e - 127), the rest 8 bf16 RoPE values
// (dims 448 + 8 (c - 28)..).
__device__ __forceinline__ void convert_chunk(uint8_t* kt, int r, int c, uint4 x, uint32_t exps_lo, uint32_t exps_hi) {
  if (c < kE4m3Chunks) {
    uint4 lo, hi;
    dequant_e4m3x16(x, scale_exponent(exps_lo, exps_hi, c >> 2), lo, hi);
    uint8_t* box = kt + (c >> 2) * kKBox;
    const int j = (c & 3) * 2;
    *reinterpret_cast<uint4*>(box + swizzled(r, j)) = lo;
    *reinterpret_cast<uint4*>(box + swizzled(r, j + 1)) = hi;
  } else {
    *reinterpret_cast<uint4*>(kt + 7 * kKBox + swizzled(r, c - kE4m3Chunks)) = bf16x8_to_f16(x);
  }
}

// ldmatrix (four 8x8 16-bit matrices, lanes 8i..8i+7 giving the row addresses of matrix i;
// .trans: transposed) and mma.sync m16n8k16 in fp16 with fp32 accumulators, for the kernels
// that run their products on mma.sync (narrow, the P.V of tokens2).
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// D[16 x 8] += A[16 x 16] . B[16 x 8], fp16 in, fp32 accumulators (rows g and g + 8, columns
// 2q4 and 2q4 + 1 per thread).
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// n / d without a division (a run-time division is a MUFU reciprocal): for 0 <= n < 2^31 and
// d >= 1, with l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1, n / d = (umulhi(m, n) + n) >> l.
struct FastDiv {
  uint32_t m, l;
  __device__ explicit FastDiv(int d) {
    l = 32 - __clz(static_cast<uint32_t>(d - 1));
    m = static_cast<uint32_t>((((1ull << l) - d) << 32) / d + 1);
  }
  __device__ __forceinline__ int operator()(int n) const {
    return static_cast<int>((__umulhi(m, static_cast<uint32_t>(n)) + static_cast<uint32_t>(n)) >> l);
  }
};

// Tiles [tile0, tile0 + n) of the token's [window tiles | entry tiles] belong to this split.
struct CtaTiles {
  int tile0, n;
  __device__ CtaTiles(const SparseParams& p, int split) {
    const int total = p.scope[0].tiles + (p.num_scopes > 1 ? p.scope[1].tiles : 0);
    tile0 = split * p.tiles_per_split;
    n = max(0, min(p.tiles_per_split, total - tile0));
  }
};

// Read-only global loads of record bytes (no L1 allocation for the data; the scale bytes are
// shared by a record's threads) and an L2 prefetch.
__device__ __forceinline__ uint4 ld_nc_16(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ld_nc_8(const uint8_t* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ld_nc_8_no_l1(const uint8_t* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ void prefetch_l2(const uint8_t* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

// Where a record is: its data row (V4: the 576 data bytes; V4.1: the whole record) and its scale
// bytes (null: no record), and whether the cache allows 16-byte loads (MODEL1 pages, V4.1 pages on
// 16 bytes; V4's one-record rows of 584 bytes are on 8 only).
struct RecordAt {
  const uint8_t* data;
  const uint8_t* scales;
  bool wide;
};
// 16 bytes of a record at byte `off` of its data row (zeros for no record).
__device__ __forceinline__ uint4 record_bytes16(const RecordAt& at, int off) {
  if (at.data == nullptr) return make_uint4(0, 0, 0, 0);
  if (at.wide) return ld_nc_16(at.data + off);
  const uint2 lo = ld_nc_8(at.data + off), hi = ld_nc_8(at.data + off + 8);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ uint2 record_scales(const RecordAt& at) {
  return at.data == nullptr ? make_uint2(0, 0) : ld_nc_8(at.scales);
}
// The record `off` bytes further on (no record stays none): a thread's base for loads at constant
// offsets.
__device__ __forceinline__ RecordAt record_plus(const RecordAt& at, int off) {
  return {at.data == nullptr ? nullptr : at.data + off, at.scales, at.wide};
}
// 8 bytes of a record's values at byte `off` (zeros for no record), not kept in L1.
__device__ __forceinline__ uint2 record_bytes8(const RecordAt& at, int off) {
  return at.data == nullptr ? make_uint2(0, 0) : ld_nc_8_no_l1(at.data + off);
}

// A CTA's view of token (b, tq)'s pick lists, for the kernels that gather by themselves: the flat
// record number at row `row` of its tile t (tiles of `tile` records; -1 past a list's length or
// the CTA's tiles), the record format of tile t (scope 0's F0 or scope 1's F1), and where a
// record number points.
struct RecordPicker {
  const SparseParams& p;
  int tile0, n, tiles0, len0, len1;
  const int* idx0;
  const int* idx1;
  FastDiv div0, div1;
  __device__ RecordPicker(const SparseParams& p_, const CtaTiles& t, int b, int tq)
      : p(p_), tile0(t.tile0), n(t.n), tiles0(p_.scope[0].tiles),
        div0(p_.scope[0].page_size), div1(p_.num_scopes > 1 ? p_.scope[1].page_size : 1) {
    const SparseScope &s0 = p.scope[0], &s1 = p.scope[1];
    const bool two = p.num_scopes > 1;
    len0 = s0.lengths ? min(s0.k, s0.lengths[b]) : s0.k;
    len1 = !two ? 0 : (s1.lengths ? min(s1.k, s1.lengths[b]) : s1.k);
    idx0 = s0.indices + b * s0.idx_sb + tq * s0.idx_ss;
    idx1 = two ? s1.indices + b * s1.idx_sb + tq * s1.idx_ss : idx0;
  }
  __device__ __forceinline__ int index(int t, int row, int tile) const {
    if (t >= n) return -1;
    const int g = tile0 + t, sc = g < tiles0 ? 0 : 1;
    const int pos = (g - (sc ? tiles0 : 0)) * tile + row;
    return pos < (sc ? len1 : len0) ? (sc ? idx1 : idx0)[pos] : -1;
  }
  template <int F0, int F1>
  __device__ __forceinline__ int format(int t) const {
    return F0 == F1 ? F0 : (tile0 + t < tiles0 ? F0 : F1);
  }
  template <int F0 = kFmtV4, int F1 = F0>
  __device__ __forceinline__ RecordAt locate(int t, int rec) const {
    if (rec < 0) return {nullptr, nullptr, false};
    const int sc = tile0 + t < tiles0 ? 0 : 1;
    const SparseScope& s = p.scope[sc];
    const int page = sc ? div1(rec) : div0(rec), slot = rec - page * s.page_size;
    const uint8_t* base = s.cache + page * s.page_stride;
    if constexpr (F0 == kFmtV4) {
      static_assert(F1 == kFmtV4, "a call reads V4 records or V4.1 records, not both");
      return {base + slot * kDataBytes, base + static_cast<long long>(s.page_size) * kDataBytes + slot * 8,
              ((s.page_stride | reinterpret_cast<uintptr_t>(s.cache)) & 15) == 0};
    } else {
      const int f = format<F0, F1>(t);
      const uint8_t* data = base + slot * v41_record_bytes(f);
      return {data, data + v41_value_bytes(f), ((s.page_stride | reinterpret_cast<uintptr_t>(s.cache)) & 15) == 0};
    }
  }
};

// The m64n256 accumulators of one warpgroup (rows 16 warp + g + 8i, dims 8j + 2q4 + e of its 256
// at o[4j + 2i + e]): both rows times a factor, and row i times `factor` to out (bf16) or to the
// split's fp32 partial (head `head`, dims 256c..).
__device__ __forceinline__ void scale_rows(float (&o)[128], float a0, float a1) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    o[4 * j] *= a0;
    o[4 * j + 1] *= a0;
    o[4 * j + 2] *= a1;
    o[4 * j + 3] *= a1;
  }
}
__device__ __forceinline__ void store_row(const SparseParams& p, const float (&o)[128], int i, float factor, int head,
                                          int c, int q4, int b, int tq, int bt, int split) {
  if (p.num_splits > 1) {
    const long long flat = static_cast<long long>(bt) * p.num_splits + split;
    float* dst = p.part_o + (flat * p.heads + head) * kDim + 256 * c + 2 * q4;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * i] * factor, o[4 * j + 2 * i + 1] * factor);
  } else {
    __nv_bfloat16* dst = p.out + b * p.o_sb + tq * p.o_ss + head * p.o_sh + 256 * c + 2 * q4;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) =
          __floats2bfloat162_rn(o[4 * j + 2 * i] * factor, o[4 * j + 2 * i + 1] * factor);
  }
}

// The online softmax of the 64-row wgmma kernels, on the m64nN score accumulators (rows 16 warp
// + g + 8i, records 8j + 2q4 + e at s[4j + 2i + e], j < J = N / 8), in log2 units with a lazy
// reference maximum m_ref per row (it moves only when a score passes it by kRescaleSlack: P <= 2^8).
constexpr float kRescaleSlack = 8.f;

// Scores times scale_log2 plus the records' biases (0 or -inf), and each row's maximum.
template <int J>
__device__ __forceinline__ void scale_and_row_max(float (&s)[4 * J], const float* bias, float scale_log2, int q4,
                                                  float (&mx)[2]) {
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const float2 bb = *reinterpret_cast<const float2*>(bias + 8 * j + 2 * q4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      s[4 * j + 2 * i] = fmaf(s[4 * j + 2 * i], scale_log2, bb.x);
      s[4 * j + 2 * i + 1] = fmaf(s[4 * j + 2 * i + 1], scale_log2, bb.y);
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = -INFINITY;
#pragma unroll
    for (int j = 0; j < J; ++j) mx[i] = fmaxf(mx[i], fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
  }
}

// Moves the reference of the rows whose maximum passed it; alpha = the factor for O and l (1 for
// a row that stays; 0 from -inf, when O and l are 0).
__device__ __forceinline__ void move_reference(const bool (&move)[2], const float (&mx)[2], float (&m_ref)[2],
                                               float (&l)[2], float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    alpha[i] = move[i] ? exp2f(m_ref[i] - mx[i]) : 1.f;
    if (move[i]) m_ref[i] = mx[i];
    l[i] *= alpha[i];
  }
}

// P = 2^(s - m_ref + shift) in place, the row sums times sum_scale (2^-shift) added to l, and P as
// the A fragments of the J / 2 P.V k-steps (records 16kk..16kk+15). shift: 0, or kEntryShift for a
// tile of V4.1 entries (P * 2^7 against their K * 2^-7).
template <int J>
__device__ __forceinline__ void exp_sum_pack(float (&s)[4 * J], const float (&m_ref)[2], float (&l)[2],
                                             uint32_t (&a)[J / 2][4], float shift = 0.f, float sum_scale = 1.f) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float m_use = (m_ref[i] == -INFINITY ? 0.f : m_ref[i]) - shift;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      s[4 * j + 2 * i] = exp2f(s[4 * j + 2 * i] - m_use);
      s[4 * j + 2 * i + 1] = exp2f(s[4 * j + 2 * i + 1] - m_use);
      sum += s[4 * j + 2 * i] + s[4 * j + 2 * i + 1];
    }
    l[i] += sum * sum_scale;
  }
#pragma unroll
  for (int kk = 0; kk < J / 2; ++kk) {
    a[kk][0] = pack_half2(s[8 * kk], s[8 * kk + 1]);
    a[kk][1] = pack_half2(s[8 * kk + 2], s[8 * kk + 3]);
    a[kk][2] = pack_half2(s[8 * kk + 4], s[8 * kk + 5]);
    a[kk][3] = pack_half2(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// A head's natural-log LSE (without the sink; -inf for no valid key) to the split's partial, or
// to lse (+inf for no valid key) when there is one split.
__device__ __forceinline__ void store_lse(const SparseParams& p, int head, float lse, int b, int tq, int bt, int split) {
  if (p.num_splits > 1) p.part_l[(static_cast<long long>(bt) * p.num_splits + split) * p.heads + head] = lse;
  else p.lse[b * p.l_sb + tq * p.l_ss + head * p.l_sh] = lse == -INFINITY ? INFINITY : lse;
}

// The CTA's Q rows [row0, row0 + kRows) of token (b, tq), bf16 -> fp16 (heads past p.heads
// zero), into the swizzled tile at q_s (boxes of kRows x 128 bytes), by `threads` threads.
template <int kRows>
__device__ __forceinline__ void load_q_tile(const SparseParams& p, int b, int tq, int row0, uint8_t* q_s, int tid,
                                            int threads) {
  for (int i = tid; i < kRows * 64; i += threads) {
    const int row = i >> 6, ch = i & 63, head = row0 + row;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (head < p.heads)
      v = bf16x8_to_f16(*reinterpret_cast<const uint4*>(p.q + b * p.q_sb + tq * p.q_ss + head * p.q_sh + 8 * ch));
    *reinterpret_cast<uint4*>(q_s + (ch >> 3) * (kRows * 128) + swizzled(row, ch & 7)) = v;
  }
}

// The producer warpgroup (tid 0..127): thread i copies 16-byte chunks (i & 3) + 4m of record
// i / 4 of each tile by cp.async into the raw stages (as two 8-byte copies where the cache's
// records are on 8 bytes only; records left out by the indices are zero-filled, never loaded), then, once the consumers released the fp16 stage, converts
// exactly the bytes it copied (its own cp.async wait is all the raw stages need), writes the
// record's score bias (0, or -inf for a record left out) and arrives on the stage's `full`
// mbarrier (128 arrivals). `empty` completes when the consumers are done with a stage.
__device__ __forceinline__ void produce_tiles(const SparseParams& p, const CtaTiles& tiles, int b, int tq, int tid,
                                              uint8_t* raw_s, uint8_t* k_s, float* bias_s, uint32_t bar_full,
                                              uint32_t bar_empty) {
  const int tile0 = tiles.tile0, n = tiles.n;
  const int r = tid >> 2, part = tid & 3;
  // The flat record number of this thread's record in tile t, or -1.
  auto fetch_index = [&](int t) -> int {
    if (t >= n) return -1;
    const int g = tile0 + t;
    const int sc = g < p.scope[0].tiles ? 0 : 1;
    const SparseScope& s = p.scope[sc];
    const int pos = (g - (sc ? p.scope[0].tiles : 0)) * kRec + r;
    const int len = s.lengths ? min(s.k, s.lengths[b]) : s.k;
    return pos < len ? s.indices[b * s.idx_sb + tq * s.idx_ss + pos] : -1;
  };
  uint32_t valid_bits = 0;  // bit (t % kRawStages): this thread's record of tile t is valid
  auto issue = [&](int t, int rec) {
    if (t < n) {
      const int slot = t % kRawStages;
      const int sc = tile0 + t < p.scope[0].tiles ? 0 : 1;
      const SparseScope& s = p.scope[sc];
      const bool valid = rec >= 0;
      valid_bits = (valid_bits & ~(1u << slot)) | (static_cast<uint32_t>(valid) << slot);
      const long long page = valid ? rec / s.page_size : 0, slot_in_page = valid ? rec - page * s.page_size : 0;
      const uint8_t* data = s.cache + page * s.page_stride + slot_in_page * kDataBytes;
      const uint8_t* scales = s.cache + page * s.page_stride + static_cast<long long>(s.page_size) * kDataBytes +
                              slot_in_page * 8;
      const uint32_t dst = smem_addr(raw_s + slot * kRawBytes);
      if (((s.page_stride | reinterpret_cast<uintptr_t>(s.cache)) & 15) == 0) {  // MODEL1 pages
#pragma unroll
        for (int m = 0; m < kChunks / 4; ++m) {
          const int c = part + 4 * m;
          cp_async_16(dst + r * kDataBytes + c * 16, valid ? data + c * 16 : s.cache, valid ? 16 : 0);
        }
      } else {  // one-record rows of 584 bytes (the V4 family's row pools): on 8 bytes only
#pragma unroll
        for (int m = 0; m < kChunks / 4; ++m) {
          const int c = part + 4 * m;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            cp_async_8(dst + r * kDataBytes + c * 16 + 8 * h, valid ? data + c * 16 + 8 * h : s.cache, valid ? 8 : 0);
        }
      }
      cp_async_8(dst + kRawData + (r * 4 + part) * 8, valid ? scales : s.cache, valid ? 8 : 0);
    }
    cp_async_commit();  // one group per tile, empty ones too: the wait below counts groups
  };
  for (int t = 0; t < kRawStages - 1; ++t) issue(t, fetch_index(t));
  int next = fetch_index(kRawStages - 1);
  for (int t = 0; t < n; ++t) {
    // The slot of tile t + 3 held tile t - 1, which this thread converted last iteration.
    issue(t + kRawStages - 1, next);
    next = fetch_index(t + kRawStages);
    cp_async_wait<kRawStages - 1>();  // this thread's copies of tile t have landed
    const int ks = t % kKStages;
    if (t >= kKStages) mbar_wait(bar_empty + 8 * ks, ((t / kKStages) - 1) & 1);
    const uint8_t* raw = raw_s + (t % kRawStages) * kRawBytes;
    uint8_t* kt = k_s + ks * kKBytes;
    const uint2 ex = *reinterpret_cast<const uint2*>(raw + kRawData + (r * 4 + part) * 8);
#pragma unroll
    for (int m = 0; m < kChunks / 4; ++m) {
      const int c = part + 4 * m;
      convert_chunk(kt, r, c, *reinterpret_cast<const uint4*>(raw + r * kDataBytes + c * 16), ex.x, ex.y);
    }
    if (part == 0) bias_s[ks * kRec + r] = (valid_bits >> (t % kRawStages)) & 1 ? 0.f : -INFINITY;
    fence_async_shared();  // the fp16 tile is read by wgmma (the async proxy)
    mbar_arrive(bar_full + 8 * ks);
  }
  cp_async_wait<0>();
}

}  // namespace
