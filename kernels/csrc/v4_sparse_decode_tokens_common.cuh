// What the two tokens-major V4 sparse decode kernels share (v4_sparse_decode_tokens_sm90a.cu and
// v4_sparse_decode_tokens2_sm90a.cu: records on wgmma's M side, their Q.K^T fragments dequantized
// straight from registers): Q in k-step order, a thread's two records of a tile in registers, and
// the V4.1 block dequantization from them.
#pragma once

#include "v4_sparse_decode_common.cuh"

namespace {

// The physical dim (within a 64-dim block) of k index kk of k-step i: the A fragment of lane q4
// holds k 2q4, 2q4+1, 2q4+8, 2q4+9 = physical 16 q4 + 4i + {0, 1, 2, 3}.
__device__ __forceinline__ int perm_dim(int i, int kk) { return 16 * ((kk & 7) >> 1) + 4 * i + 2 * (kk >> 3) + (kk & 1); }

// Q rows 0..kRows-1 of token (b, tq), bf16 -> fp16 (heads past p.heads zero), each 64-dim block's
// k-step i in perm_dim order, into 8 boxes of kRows rows x 128 bytes (128-byte swizzle), by
// kThreads threads.
template <int kRows, int kThreads>
__device__ __forceinline__ void load_q_perm(const SparseParams& p, int b, int tq, uint8_t* q_s, int tid) {
  for (int c = tid; c < kRows * 64; c += kThreads) {  // c = row, block, 16-byte chunk
    const int row = c >> 6, blk = (c >> 3) & 7, ch = c & 7, i = ch >> 1;
    uint32_t h[4] = {0, 0, 0, 0};
    if (row < p.heads) {
      const __nv_bfloat16* src = p.q + b * p.q_sb + tq * p.q_ss + row * p.q_sh + 64 * blk;
#pragma unroll
      for (int k = 0; k < 4; ++k)  // k indices 8 (ch & 1) + 2k, +1: adjacent physical dims
        h[k] = bf16x2_to_f16x2(*reinterpret_cast<const uint32_t*>(src + perm_dim(i, 8 * (ch & 1) + 2 * k)));
    }
    *reinterpret_cast<uint4*>(q_s + blk * (kRows * 128) + swizzled(row, ch)) = make_uint4(h[0], h[1], h[2], h[3]);
  }
}

// The same Q tile in two steps, so that its loads are all in flight together (and under the first
// tile's): `load` the thread's chunks (bf16 pairs, zeros past p.heads) into registers, `store` them
// as fp16 once they are needed.
template <int kRows, int kThreads>
struct QPermChunks {
  static constexpr int kPerThread = kRows * 64 / kThreads;
  static_assert(kPerThread * kThreads == kRows * 64, "Q chunks must divide among the threads");
  uint32_t w[kPerThread][4];
  __device__ __forceinline__ void load(const SparseParams& p, int b, int tq, int tid) {
#pragma unroll
    for (int n = 0; n < kPerThread; ++n) {
      const int c = tid + n * kThreads, row = c >> 6, blk = (c >> 3) & 7, ch = c & 7, i = ch >> 1;
      const __nv_bfloat16* src = p.q + b * p.q_sb + tq * p.q_ss + row * p.q_sh + 64 * blk;
#pragma unroll
      for (int k = 0; k < 4; ++k)  // k indices 8 (ch & 1) + 2k, +1: adjacent physical dims
        w[n][k] = row < p.heads ? *reinterpret_cast<const uint32_t*>(src + perm_dim(i, 8 * (ch & 1) + 2 * k)) : 0u;
    }
  }
  __device__ __forceinline__ void store(uint8_t* q_s, int tid) const {
#pragma unroll
    for (int n = 0; n < kPerThread; ++n) {
      const int c = tid + n * kThreads, row = c >> 6, blk = (c >> 3) & 7, ch = c & 7;
      *reinterpret_cast<uint4*>(q_s + blk * (kRows * 128) + swizzled(row, ch)) =
          make_uint4(bf16x2_to_f16x2(w[n][0]), bf16x2_to_f16x2(w[n][1]), bf16x2_to_f16x2(w[n][2]),
                     bf16x2_to_f16x2(w[n][3]));
    }
  }
};

// A thread's two records of one tile, whether the indices pick them, and their pieces. V4: 16-byte
// pieces (blocks 0-6, then the two RoPE halves) and the 8 scale bytes in ex. V4.1 window: block blk's
// 16 bytes in d[blk], the 16 scale bytes in d[8]. V4.1 entry: block blk's 8 bytes of codes in
// d[blk].xy, the scale words blk - 1 and blk in d[blk].zw for odd blk. A block's registers are
// refilled with the next tile's once it is converted, in every format, so that a tile of one
// format can follow one of the other.
struct TwoRecords {
  uint4 d[2][9];
  uint2 ex[2];
  bool valid[2];
};

// Record r's 16 values of block blk (format F) in natural order as fp16 pairs (an entry's times
// 2^-kEntryShift). Window: the scale byte of dims 64 blk + 16 q4.. is byte 2 blk + q4 / 2 of d[8]
// (`ex_shift` = 8 (q4 / 2)). Entry: at an even block the scales of blocks blk and blk + 1 (byte q4
// of scale words blk, blk + 1; `sel` = q4 | (4 + q4) << 4); the odd block's is kept in `s_odd`.
template <int F>
__device__ __forceinline__ void v41_block_values(const TwoRecords& raw, int r, int blk, uint32_t ex_shift,
                                                 uint32_t sel, __half2& s_odd, uint32_t (&h)[8]) {
  uint4 lo, hi;
  if constexpr (F == kFmtWindow) {
    const uint4& sc = raw.d[r][8];
    const uint32_t w = (blk >> 1) == 0 ? sc.x : (blk >> 1) == 1 ? sc.y : (blk >> 1) == 2 ? sc.z : sc.w;
    dequant_e4m3x16(raw.d[r][blk], (w >> (16 * (blk & 1) + ex_shift)) & 0xFF, lo, hi);
  } else {
    __half2 s2;
    if ((blk & 1) == 0) {
      const __half2 pair = e4m3x2_scale_x128(__byte_perm(raw.d[r][blk + 1].z, raw.d[r][blk + 1].w, sel));
      s2 = __low2half2(pair);
      s_odd = __high2half2(pair);
    } else {
      s2 = s_odd;
    }
    dequant_e2m1x16(raw.d[r][blk].x, raw.d[r][blk].y, s2, lo, hi);
  }
  h[0] = lo.x, h[1] = lo.y, h[2] = lo.z, h[3] = lo.w, h[4] = hi.x, h[5] = hi.y, h[6] = hi.z, h[7] = hi.w;
}

// The epilogue's softmax finish: each head's row sum over the 8 lane groups and then the 4 warps
// (through `sums`, 4 x kRows floats), after which the warpgroup syncs on barrier kBar; then each
// lane's output factors (1 / l, and the sink's share when the call is not split) and, from warp 0,
// the heads' LSEs.
template <int kJ, int kRows, int kBar>
__device__ __forceinline__ void finish_rows(const SparseParams& p, float* sums, const float (&l_part)[kJ][2],
                                            const float (&m_ref)[kJ][2], float (&factor)[kJ][2], int warp, int g,
                                            int q4, int b, int tq, int bt, int split) {
#pragma unroll
  for (int j = 0; j < kJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = l_part[j][e];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      if (g == 0) sums[warp * kRows + 8 * j + 2 * q4 + e] = l;
    }
  named_barrier_sync(kBar, 128);  // also: every warp of warpgroup 0 is done with its tile
  const bool split_kv = p.num_splits > 1;
#pragma unroll
  for (int j = 0; j < kJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int head = 8 * j + 2 * q4 + e;
      const float l = sums[head] + sums[kRows + head] + sums[2 * kRows + head] + sums[3 * kRows + head];
      const bool lonely = !(l > 0.f);
      const float lse = lonely ? -INFINITY : (m_ref[j][e] + log2f(l)) * kLn2;
      float f = lonely ? 0.f : 1.f / l;
      if (!split_kv && p.sinks != nullptr && !lonely && head < p.heads) f /= 1.f + expf(p.sinks[head] - lse);
      factor[j][e] = f;
      if (warp == 0 && g == 0 && head < p.heads) store_lse(p, head, lse, b, tq, bt, split);
    }
}

// The staged output rows (`stage`: kRows heads of 512 floats, kStageRow floats apart) written out
// by the warpgroup's 128 threads in coalesced 16-byte pieces: the split's fp32 partial, or bf16 out.
template <int kRows, int kStageRow>
__device__ __forceinline__ void store_rows(const SparseParams& p, const float* stage, int tw, int b, int tq, int bt,
                                           int split) {
  const bool split_kv = p.num_splits > 1;
  for (int c = tw; c < kRows * 128; c += 128) {  // c = head, 4-dim group
    const int head = c >> 7, d4 = (c & 127) * 4;
    if (head >= p.heads) continue;
    const float4 v = *reinterpret_cast<const float4*>(stage + head * kStageRow + d4);
    if (split_kv) {
      const long long flat = static_cast<long long>(bt) * p.num_splits + split;
      *reinterpret_cast<float4*>(p.part_o + (flat * p.heads + head) * kDim + d4) = v;
    } else {
      __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(p.out + b * p.o_sb + tq * p.o_ss + head * p.o_sh + d4);
      dst[0] = __floats2bfloat162_rn(v.x, v.y);  // out's contract: 4-byte aligned pairs
      dst[1] = __floats2bfloat162_rn(v.z, v.w);
    }
  }
}

}  // namespace
