// Paged MLA decode with an FP8 (e4m3) query and latent cache, for Hopper (sm_90), CUDA C++.
//
// Same contract as kernels/mla_decode.py::mla_decode_reference (see kernels/mla_decode_cuda.py
// for the Python side). Why this design (benchmarks/KERNEL_NOTES.md has the numbers):
//
// - Few query rows (16 heads per GPU under TP8, V2-Lite's 16 heads, s_q <= 4) make decode
//   memory-bound: the kernel must stream the cache at HBM speed with little work per byte.
//   Rows sit on the M=16 side of warp-level mma.sync, so no MMA row is padding when
//   heads x s_q is a multiple of 16 (wgmma's M=64 would waste 3/4 of every product).
// - Hopper has FP8 tensor-core math only through wgmma (M = 64 rows); an e4m3 mma.sync is
//   emulated by ptxas, which widens both operands to f16 on every use (measured: 280 conversions
//   per warp per tile, the kernel's bottleneck). So Q is widened to f16 once, into shared
//   memory, and each K byte pair is widened exactly once in registers (ldmatrix of the FP8
//   tile as stored: rows = tokens, 16 bytes = one k-step of 16 dims, in a k order that Q's
//   shared-memory layout mirrors); Q.K^T then runs on f16 mma.sync (m16n8k16).
// - P.V runs in fp16 (m16n8k16): an FP8 B operand must be K-major, i.e. V transposed, which
//   is what makes Triton's FP8 P.V slow (byte-wise transposes). Instead `ldmatrix.trans` reads the FP8 V tile as 16-bit
//   pairs, one byte permute regroups the pairs per dimension, and the hardware converts
//   e4m3x2 -> f16x2 (exact). Output dimensions then come out interleaved (even/odd), which
//   the epilogue undoes for free: each thread ends up owning 4 consecutive dims.
// - A CTA = C column groups (4 or 8) x R row groups of warps. For each tile, warp (r, c)
//   computes scores for rows 16r.. and its share of the tile's tokens, the row maxima are
//   exchanged through shared memory, P (fp16) goes to shared memory, and warp (r, c)
//   accumulates O[rows 16r.., its 512/C dims] over the whole tile: no duplicated Q.K^T, and
//   with C = 4 O takes 64 registers.
// - Tiles are 64 (or 32) consecutive tokens of one page, copied with cp.async (16 B per
//   thread, consecutive threads on consecutive chunks; rows padded by 16 B so ldmatrix is
//   bank-conflict free), STAGES deep. Tokens past the
//   sequence are zero-filled by the copy (src-size 0), so poisoned (NaN) slots never reach
//   the P.V product.
// - Split-KV: blockIdx.z takes a contiguous range of tiles and writes a normalized partial
//   output plus its log-sum-exp; a combine kernel (kernels/mla_decode_triton.py) merges them.
//   The grid depends only on shapes, so a launch can be captured in a CUDA graph.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "mla_decode_common.cuh"

namespace {

constexpr int kDim = 576;                 // latent (512) + rope (64)
constexpr int kDimV = 512;                // the value is the latent
constexpr int kRowBytes = kDim + 16;      // padded shared-memory row (conflict-free ldmatrix)
constexpr int kChunksPerRow = kDim / 16;  // 16-byte chunks per cache row
constexpr int kQRowBytes = 2 * kDim + 16; // fp16 Q row, padded (conflict-free ldmatrix)
constexpr float kLn2 = 0.6931471805599453f;



__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// D += A(16x16 f16, row) * B(16x8 f16, col), fp32 accumulate.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four e4m3 bytes -> two f16x2 (bytes 0,1 -> lo; bytes 2,3 -> hi), one conversion each, reading
// the upper half in place (no shift).
__device__ __forceinline__ void e4m3x4_to_f16x2x2(uint32_t v, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(v));
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Halves per row of the P tile: TILE + 8 keeps ldmatrix rows on distinct banks (144 B or 80 B).
template <int TILE>
__host__ __device__ constexpr int p_stride() { return TILE + 8; }

template <int R, int C, int STAGES, int TILE>
__host__ __device__ constexpr int smem_bytes() {
  return 16 * R * kQRowBytes                 // Q (fp16)
         + STAGES * TILE * kRowBytes         // cache tiles
         + 16 * R * p_stride<TILE>() * 2     // P (fp16)
         + 2 * R * C * 16 * 4;               // row maxima and row sums exchanged by warps
}

// One CTA: 16*R query rows of request blockIdx.y, tile range blockIdx.z of its cache, R x C
// warps (C = 4 or 8 column groups), STAGES tiles of TILE (64 or 32) tokens in flight. 32-token
// tiles shrink shared memory so that three 4-warp CTAs fit on an SM (registers capped to match).
template <int R, int C, int STAGES, int TILE>
__global__ void __launch_bounds__(32 * R * C, (TILE == 32 && R * C == 4) ? 3 : ((32 * R * C <= 256) ? 2 : 1))
    mla_decode_fp8_kernel(const Params p) {
  constexpr int kTile = TILE;
  constexpr int kPStride = p_stride<TILE>();
  static_assert(TILE % (8 * C) == 0, "each warp takes whole 8-token blocks of a tile");
  constexpr int kCols = C;
  constexpr int kThreads = 32 * R * C;
  constexpr int kRows = 16 * R;
  constexpr int kDimsPerWarp = kDimV / C;    // 128 or 64 output dims per warp
  constexpr int kTokPerWarp = kTile / C;     // 16 or 8 tokens of each tile's scores per warp
  constexpr int kNB = kTokPerWarp / 8;       // n-blocks of 8 tokens per warp in Q.K^T
  constexpr int kCopies = (kTile * kChunksPerRow + kThreads - 1) / kThreads;  // 16-byte copies per thread
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* q_s = smem;
  uint8_t* kv_s = q_s + kRows * kQRowBytes;
  __half* p_s = reinterpret_cast<__half*>(kv_s + STAGES * kTile * kRowBytes);
  float* red_max = reinterpret_cast<float*>(p_s + kRows * kPStride);
  float* red_sum = red_max + R * kCols * 16;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int rg = warp / kCols, cg = warp % kCols;  // row group, column group
  const int g = lane >> 2, t = lane & 3;           // mma fragment coordinates
  const int b = blockIdx.y, split = blockIdx.z;
  const int rows_total = p.s_q * p.heads;
  const int row0 = blockIdx.x * kRows;

  const int seq_len = p.seq_lens[b];
  const TileRange tiles(seq_len, kTile, p.num_splits, split);
  const int tile_begin = tiles.begin, tile_end = tiles.end;

  // Q rows of this CTA -> fp16 in shared memory (exact), rows past the request are zero.
  // Hopper has no FP8 mma.sync (ptxas widens both operands to f16 on every use), so Q is
  // widened once here. Within each 16-dim block the dims are stored in the order the K
  // fragments arrive from ldmatrix (dims 4t..4t+1 at k = 2t.., dims 4t+2.. at k = 8+2t..),
  // so that a plain ldmatrix of Q pairs with the K bytes as they are.
  for (int c = tid; c < kRows * kChunksPerRow; c += kThreads) {
    const int r = c / kChunksPerRow, k = c % kChunksPerRow;
    const int row = row0 + r;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (row < rows_total) {
      const int j = row / p.heads, h = row % p.heads;
      v = *reinterpret_cast<const uint4*>(p.q + b * p.q_sb + j * p.q_ss + h * p.q_sh + k * 16);
    }
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t hw[8];
#pragma unroll
    for (int i = 0; i < 4; ++i)  // word i holds dims 4i..4i+3: 4i, 4i+1 -> k 2i..; 4i+2, 4i+3 -> k 8+2i..
      e4m3x4_to_f16x2x2(w[i], hw[i], hw[4 + i]);
    uint4* dst = reinterpret_cast<uint4*>(q_s + r * kQRowBytes + k * 32);
    dst[0] = make_uint4(hw[0], hw[1], hw[2], hw[3]);
    dst[1] = make_uint4(hw[4], hw[5], hw[6], hw[7]);
  }

  const int* bt_row = p.block_tables + b * p.bt_s;
  // A tile is 64 consecutive rows of one page (contiguous in memory): consecutive threads copy
  // consecutive 16-byte chunks, fully coalesced; smem rows are padded by 16 bytes.
  auto load_tile = [&](int tile, int stage) {
    const int tok0 = tile * kTile;
    const long long page = bt_row[tok0 / p.page_size];
    const uint8_t* src = p.kv + page * p.kv_sp + static_cast<long long>(tok0 % p.page_size) * kDim;
    const uint32_t dst = smem_addr(kv_s + stage * kTile * kRowBytes);
    const int valid_rows = seq_len - tok0;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const unsigned c = tid + kThreads * i;
      if (kCopies * kThreads == kTile * kChunksPerRow || c < kTile * kChunksPerRow) {
        const unsigned r = c / kChunksPerRow;
        const bool valid = static_cast<int>(r) < valid_rows;
        cp_async_16(dst + 16 * (c + r), src + (valid ? 16 * c : 0), valid ? 16 : 0);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (tile_begin + s < tile_end) load_tile(tile_begin + s, s);
    cp_async_commit();
  }
  __syncthreads();  // Q in shared memory

  // ldmatrix addresses. Q (A of m16n8k16, fp16): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15).
  const uint32_t q_addr =
      smem_addr(q_s + (rg * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kQRowBytes + 16 * (lane >> 4));
  // K (B of m16n8k16 after widening; each 16-byte matrix row is one k-step of 16 dims). Two
  // n-blocks: tokens (0-7 | 8-15) of this warp x (bytes 0-15 | 16-31); one n-block: tokens 0-7 x
  // bytes (0-15 | 16-31 | 32-47 | 48-63).
  const uint32_t k_off = kNB == 2
      ? (cg * kTokPerWarp + (lane & 7) + 8 * (lane >> 4)) * kRowBytes + 16 * ((lane >> 3) & 1)
      : (cg * kTokPerWarp + (lane & 7)) * kRowBytes + 16 * (lane >> 3);
  // P (A of m16n8k16): rows (0-7 | 8-15) x (halves 0-7 | 8-15).
  const uint32_t p_addr =
      smem_addr(p_s + (rg * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kPStride + 8 * (lane >> 4));
  // V (B of m16n8k16 via .trans): tokens (0-7 | 8-15) x (16 dims | next 16 dims).
  const uint32_t v_off = ((lane & 7) + 8 * ((lane >> 3) & 1)) * kRowBytes + cg * kDimsPerWarp + 16 * (lane >> 4);

  // Causal limit (number of visible keys) of this thread's two rows.
  int limit[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = min(row0 + rg * 16 + g + 8 * i, rows_total - 1);
    limit[i] = seq_len - p.s_q + row / p.heads + 1;
  }

  float o[kDimsPerWarp / 16][2][4];  // [16-dim chunk][even/odd dims][fragment]
#pragma unroll
  for (int c = 0; c < kDimsPerWarp / 16; ++c)
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int f = 0; f < 4; ++f) o[c][e][f] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};  // this thread's share of the row sums

  for (int tile = tile_begin, it = 0; tile < tile_end; ++tile, ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile `it` landed for every thread; the stage refilled next is free
    {
      const int next = tile + STAGES - 1;
      if (next < tile_end) load_tile(next, (it + STAGES - 1) % STAGES);
      cp_async_commit();
    }
    const uint32_t stage = smem_addr(kv_s + (it % STAGES) * kTile * kRowBytes);

    // S = Q . K^T for 16 rows x this warp's tokens (f16 MMAs; the e4m3 K bytes are widened
    // in registers, exactly); even and odd k-steps accumulate apart (shorter MMA chains).
    float acc[2][kNB][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[a][nb][e] = 0.f;
    constexpr int kStepsPerLoad = 4 / kNB;  // k-steps of 16 dims per K ldmatrix.x4
#pragma unroll
    for (int kl = 0; kl < kDim / (16 * kStepsPerLoad); ++kl) {
      uint32_t kb[4];  // two n-blocks: {nb0 step0, nb0 step1, nb1 step0, nb1 step1}; one: steps 0..3
      ldsm_x4(stage + k_off + kl * 16 * kStepsPerLoad, kb);
#pragma unroll
      for (int st = 0; st < kStepsPerLoad; ++st) {
        const int ks = kl * kStepsPerLoad + st;
        uint32_t qa[4];
        ldsm_x4(q_addr + ks * 32, qa);
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) {
          uint32_t b0, b1;
          e4m3x4_to_f16x2x2(kb[nb * kStepsPerLoad + st], b0, b1);
          mma_f16(acc[ks & 1][nb], qa, b0, b1);
        }
      }
    }
    float s[kNB][4];
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nb][e] = acc[0][nb][e] + acc[1][nb][e];

    // Scale to log2 units, mask, and take this warp's row maxima.
    const int tok_base = tile * kTile + cg * kTokPerWarp + 2 * t;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e >> 1;
        const int tok = tok_base + nb * 8 + (e & 1);
        const float v = tok < limit[i] ? s[nb][e] * p.scale_log2 : -INFINITY;
        s[nb][e] = v;
        mx[i] = fmaxf(mx[i], v);
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    }
    if (t == 0) {
      red_max[(rg * kCols + cg) * 16 + g] = mx[0];
      red_max[(rg * kCols + cg) * 16 + g + 8] = mx[1];
    }
    __syncthreads();

    float alpha[2], m_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float m_tile = -INFINITY;
#pragma unroll
      for (int c = 0; c < kCols; ++c) m_tile = fmaxf(m_tile, red_max[(rg * kCols + c) * 16 + g + 8 * i]);
      const float m_new = fmaxf(m_run[i], m_tile);
      m_use[i] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet stays at 0
      alpha[i] = exp2f(m_run[i] - m_use[i]);
      m_run[i] = m_new;
    }

    // P = exp2(S - m) -> fp16 in shared memory; this thread's share of the row sums.
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb) {
      const float p0 = exp2f(s[nb][0] - m_use[0]), p1 = exp2f(s[nb][1] - m_use[0]);
      const float p2 = exp2f(s[nb][2] - m_use[1]), p3 = exp2f(s[nb][3] - m_use[1]);
      sum[0] += p0 + p1;
      sum[1] += p2 + p3;
      const int col = cg * kTokPerWarp + nb * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(p_s + (rg * 16 + g) * kPStride + col) = pack_half2(p0, p1);
      *reinterpret_cast<uint32_t*>(p_s + (rg * 16 + g + 8) * kPStride + col) = pack_half2(p2, p3);
    }
    l_run[0] = l_run[0] * alpha[0] + sum[0];
    l_run[1] = l_run[1] * alpha[1] + sum[1];
    if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
      for (int c = 0; c < kDimsPerWarp / 16; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          o[c][e][0] *= alpha[0];
          o[c][e][1] *= alpha[0];
          o[c][e][2] *= alpha[1];
          o[c][e][3] *= alpha[1];
        }
    }
    __syncthreads();  // P complete

    // O[16 rows, this warp's 128 dims] += P[16, 64] . V[64, 128 dims].
#pragma unroll
    for (int ks = 0; ks < kTile / 16; ++ks) {
      uint32_t pa[4];
      ldsm_x4(p_addr + ks * 32, pa);
#pragma unroll
      for (int cp = 0; cp < kDimsPerWarp / 32; ++cp) {
        uint32_t v[4];  // (chunk 2cp: tokens 0-7, 8-15), (chunk 2cp+1: tokens 0-7, 8-15)
        ldsm_x4_trans(stage + v_off + ks * 16 * kRowBytes + cp * 32, v);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // v[2h] bytes: V[t0][2j], V[t0][2j+1], V[t0+1][2j], V[t0+1][2j+1] (t0 = 2t, j = g);
          // v[2h+1] the same 8 tokens later. Regroup per dimension, then widen to f16.
          const uint32_t even = __byte_perm(v[2 * h], v[2 * h + 1], 0x6420);
          const uint32_t odd = __byte_perm(v[2 * h], v[2 * h + 1], 0x7531);
          uint32_t e0, e1, o0, o1;
          e4m3x4_to_f16x2x2(even, e0, e1);
          e4m3x4_to_f16x2x2(odd, o0, o1);
          mma_f16(o[2 * cp + h][0], pa, e0, e1);
          mma_f16(o[2 * cp + h][1], pa, o0, o1);
        }
      }
    }
  }

  // Row sums: across the 4 lanes of a row, then across the column groups.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
  }
  if (t == 0) {
    red_sum[(rg * kCols + cg) * 16 + g] = l_run[0];
    red_sum[(rg * kCols + cg) * 16 + g + 8] = l_run[1];
  }
  __syncthreads();

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + rg * 16 + g + 8 * i;
    if (row >= rows_total) continue;
    float l = 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) l += red_sum[(rg * kCols + c) * 16 + g + 8 * i];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float lse = l > 0.f ? (m_run[i] + log2f(l)) * kLn2 : -INFINITY;
    const int dim0 = cg * kDimsPerWarp + 4 * t;
    if (p.num_splits > 1) {
      const long long flat = static_cast<long long>(b) * rows_total + row;
      float* dst = p.part_o + (flat * p.num_splits + split) * kDimV + dim0;
#pragma unroll
      for (int c = 0; c < kDimsPerWarp / 16; ++c) {
        const float4 val = make_float4(o[c][0][2 * i] * inv, o[c][1][2 * i] * inv, o[c][0][2 * i + 1] * inv,
                                       o[c][1][2 * i + 1] * inv);
        *reinterpret_cast<float4*>(dst + 16 * c) = val;
      }
      if (cg == 0 && t == 0) p.part_l[flat * p.num_splits + split] = lse;
    } else {
      const int j = row / p.heads, h = row % p.heads;
      const float sc = inv * p.out_scale;
      __nv_bfloat16* dst = p.out + b * p.o_sb + j * p.o_ss + h * p.o_sh + dim0;
#pragma unroll
      for (int c = 0; c < kDimsPerWarp / 16; ++c) {
        __nv_bfloat162 lo = __floats2bfloat162_rn(o[c][0][2 * i] * sc, o[c][1][2 * i] * sc);
        __nv_bfloat162 hi = __floats2bfloat162_rn(o[c][0][2 * i + 1] * sc, o[c][1][2 * i + 1] * sc);
        uint2 packed;
        packed.x = *reinterpret_cast<uint32_t*>(&lo);
        packed.y = *reinterpret_cast<uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(dst + 16 * c) = packed;
      }
      if (cg == 0 && t == 0) p.lse[b * p.l_sb + j * p.l_ss + h * p.l_sh] = lse;
    }
  }
}

template <int R, int C, int STAGES, int TILE>
int launch(const Params& p, cudaStream_t stream) {
  constexpr int smem = smem_bytes<R, C, STAGES, TILE>();
  auto kernel = mla_decode_fp8_kernel<R, C, STAGES, TILE>;
  static bool configured = false;  // per instantiation; the attribute is per function
  if (!configured) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  const int rows = p.s_q * p.heads;
  dim3 grid((rows + 16 * R - 1) / (16 * R), p.batch, p.num_splits);
  kernel<<<grid, 32 * R * C, smem, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

// The launch shapes this library carries: (row groups R, column groups C, stages, tile tokens).
#define MLA_DECODE_SHAPES(X) \
  X(1, 4, 2, 64)             \
  X(1, 8, 2, 64)             \
  X(1, 8, 3, 64)             \
  X(2, 4, 2, 64)             \
  X(2, 8, 2, 64)             \
  X(4, 4, 2, 64)             \
  X(1, 4, 2, 32)             \
  X(1, 4, 3, 32)

extern "C" {

// Returns a cudaError_t (0 = success); -1 for a launch shape this library does not carry.
int mla_decode_fp8_sm90(const Params* p, int row_groups, int col_groups, int stages, int tile, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
#define X(R, C, S, T) \
  if (row_groups == R && col_groups == C && stages == S && tile == T) return launch<R, C, S, T>(*p, s);
  MLA_DECODE_SHAPES(X)
#undef X
  return -1;
}

int mla_decode_fp8_sm90_smem_bytes(int row_groups, int col_groups, int stages, int tile) {
#define X(R, C, S, T) \
  if (row_groups == R && col_groups == C && stages == S && tile == T) return smem_bytes<R, C, S, T>();
  MLA_DECODE_SHAPES(X)
#undef X
  return -1;
}

int mla_decode_fp8_sm90_params_bytes() { return static_cast<int>(sizeof(Params)); }

}  // extern "C"
