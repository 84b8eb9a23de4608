// DeepSeek-V4 sparse decode for up to 16 heads per GPU (TP8 of V4, MTP drafts), the "v2" variant's
// narrow kernel: records on wgmma's M side (tokens-major), so 16 query rows cost no 64-row
// padding, and the records go from registers straight into the Q.K^T product. Same contract,
// records and split-KV partials as the other V4 sparse decode kernels; the Python side is
// kernels/v4_sparse_decode_cuda.py, the design and its budget benchmarks/KERNEL_NOTES.md.
//
// - A CTA = one query token x its heads (16 rows; fewer heads are zero rows) x one split of the
//   token's 64-record tiles, two warpgroups taking alternate tiles, each with its own softmax
//   state (merged at the end as two partial softmaxes). No producer warpgroup, no mbarriers.
// - Thread (warp w, g, q4) of a warpgroup owns records 16w + g and 16w + g + 8 of each of its
//   tiles, and of every 64-dim block the 16 values at 16 q4.. (e4m3 bytes, or bf16 RoPE values):
//   one 16-byte load per block (two for RoPE), issued one tile ahead into registers. Dequantized
//   (e4m3 pair -> f16x2 times the power-of-two scale), those 16 values are exactly the thread's
//   A fragments of four k-steps of S^T = K.Q^T (m64n16k16, A from registers) when the 16 dims of
//   k-step i are read in the order {16q + 4i + e}: Q is stored in that order (once per CTA), so
//   each record is converted once and never read back for the scores.
// - The same fp16 values are stored once, in natural order, into the warpgroup's fp16 tile in
//   wgmma's 128-byte-swizzled layout; O^T[512 x 16] += V^T.P^T (m64n16k16, V^T = that tile read
//   M-major, P^T stored by stmatrix.trans) keeps all 512 dims of the 16 rows in 64 registers.
// - Softmax over records per head (a column of S^T): lane-group shuffles, and a lazy reference
//   maximum that moves only past 2^8 (one bar.red.or per tile; maxima exchanged only then).
// - Record formats per scope (template F0, F1): V4's MODEL1 record, or V4.1's window row (a block's
//   16 values are 16 e4m3 bytes, as V4's) and compressed entry (8 bytes of e2m1 codes and one e4m3
//   scale per block; its tiles hold K * 2^-7, kEntryShift in v4_sparse_decode_common.cuh).

#include "v4_sparse_decode_tokens_common.cuh"

namespace {

constexpr int kTT = 64;                   // records per tile (wgmma M)
constexpr int kHeadRows = 16;             // query rows (wgmma N)
constexpr int kTokThreads = 256;          // two warpgroups on alternate tiles
constexpr int kTBox = kTT * 128;          // 8192: one 64-dim box of a tile
constexpr int kTTile = 8 * kTBox;         // 65536
constexpr int kQBox16 = kHeadRows * 128;  // 2048
constexpr int kPtBytes = kHeadRows * 128;  // P^T: 16 heads x 64 records fp16, one swizzled box
constexpr int kStageRow = 516;            // floats per head row of the epilogue's staging (bank spread)

constexpr int kSmQ = 0;
constexpr int kSmV = kSmQ + 8 * kQBox16;       // one fp16 tile per warpgroup
constexpr int kSmPt = kSmV + 2 * kTTile;       // one P^T per warpgroup
constexpr int kSmX = kSmPt + 2 * kPtBytes;     // per warpgroup and warp: 16 column maxima; the row sums
constexpr int kSmTokBytes = kSmX + 2 * 4 * kHeadRows * 4 + 1024;
static_assert(kSmTokBytes <= 227 * 1024, "shared memory plan exceeds the SM's 227 KB");
static_assert(kHeadRows * kStageRow * 4 <= kTTile, "the epilogue's staging must fit in a tile");

// Named barriers: per warpgroup w (128 threads) 1 + 4w: top of an iteration (everyone's last P.V
// done), + 1: any reference maximum moves, + 2: maxima exchanged, + 3: P^T and the tile stored;
// 9: both warpgroups (the merge), 10: warpgroup 0's epilogue.
constexpr int kBarMerge = 9, kBarEpi = 10;

// Loads V4.1 record r's pieces of block blk (format F) into `raw` (`at` already points at this
// thread's bytes of block 0: 16 q4 for a window row, 8 q4 for an entry; `rec`: the record itself).
template <int F>
__device__ __forceinline__ void load_v41_block(TwoRecords& raw, int r, int blk, const RecordAt& at,
                                               const RecordAt& rec) {
  if constexpr (F == kFmtWindow) {
    raw.d[r][blk] = record_bytes16(at, 64 * blk);
    if (blk == 7) raw.d[r][8] = record_bytes16(rec, 512);
  } else {
    const uint2 v = record_bytes8(at, 32 * blk);
    raw.d[r][blk].x = v.x, raw.d[r][blk].y = v.y;
    if (blk & 1) {
      const uint2 sc = rec.data == nullptr ? make_uint2(0, 0) : ld_nc_8(rec.scales + 4 * (blk - 1));
      raw.d[r][blk].z = sc.x, raw.d[r][blk].w = sc.y;
    }
  }
}

template <int F0, int F1>
__global__ void __launch_bounds__(kTokThreads, 1) v4_sparse_decode_tokens_kernel(const __grid_constant__ SparseParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int tw = tid & 127, warp = tw >> 5, lane = tid & 31, g = lane >> 2, q4 = lane & 3;
  const int bt = blockIdx.y, split = blockIdx.z;
  const int b = bt / p.s_q, tq = bt % p.s_q;
  const CtaTiles tiles(p, split);
  const int n = tiles.n;
  load_q_perm<kHeadRows, kTokThreads>(p, b, tq, smem + kSmQ, tid);
  fence_async_shared();
  __syncthreads();

  uint8_t* v_s = smem + kSmV + wg * kTTile;
  float* xchg = reinterpret_cast<float*>(smem + kSmX) + wg * 4 * kHeadRows;
  const uint32_t q_base = smem_addr(smem + kSmQ), v_base = smem_addr(v_s), pt_base = smem_addr(smem + kSmPt + wg * kPtBytes);
  const int bar0 = 1 + 4 * wg;

  const RecordPicker pick(p, tiles, b, tq);
  // Piece m (< 9) of a record: e4m3 block m's 16 bytes at 16 q4, or RoPE bytes 448 + 32 q4 + 16 (m - 7).
  auto load_piece = [&](const RecordAt& at, int m) {
    return record_bytes16(at, m < 7 ? 64 * m + 16 * q4 : 448 + 32 * q4 + 16 * (m - 7));
  };

  float o[8][8];  // O^T: dims 64 mb + 16 warp + g + 8i, heads 8j + 2q4 + e at o[mb][4j + 2i + e]
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int k = 0; k < 8; ++k) o[mb][k] = 0.f;
  float m_ref[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}}, l_part[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
  const int row0 = 16 * warp + g;  // this thread's records row0, row0 + 8

  // V4.1: where this thread's bytes of a record start, the scale byte's shift (window) and the
  // scale gather (entry), the odd blocks' entry scales.
  auto mine = [&](const RecordAt& at, int t) {
    return record_plus(at, pick.format<F0, F1>(t) == kFmtWindow ? 16 * q4 : 8 * q4);
  };
  const uint32_t ex_shift = 8 * (q4 >> 1), sel = static_cast<uint32_t>(q4) | static_cast<uint32_t>(4 + q4) << 4;
  __half2 s_odd[2];

  TwoRecords raw;
  {
    const int t = wg;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (F0 == kFmtV4) {
        const RecordAt at = pick.locate(t, pick.index(t, row0 + 8 * r, kTT));
        raw.valid[r] = at.data != nullptr;
#pragma unroll
        for (int m = 0; m < 9; ++m) raw.d[r][m] = load_piece(at, m);
        raw.ex[r] = record_scales(at);
      } else {
        const RecordAt at = pick.locate<F0, F1>(t, pick.index(t, row0 + 8 * r, kTT)), my = mine(at, t);
        raw.valid[r] = at.data != nullptr;
        const bool f1 = pick.format<F0, F1>(t) != F0;
#pragma unroll
        for (int blk = 0; blk < 8; ++blk) {
          if (f1) load_v41_block<F1>(raw, r, blk, my, at);
          else load_v41_block<F0>(raw, r, blk, my, at);
        }
      }
    }
  }
  int next_idx[2] = {pick.index(wg + 2, row0, kTT), pick.index(wg + 2, row0 + 8, kTT)};

  for (int t = wg; t < n; t += 2) {
    if (t >= 2) named_barrier_sync(bar0, 128);  // every warp's last P.V has read the tile and P^T
    const RecordAt nw[2] = {pick.locate<F0, F1>(t + 2, next_idx[0]), pick.locate<F0, F1>(t + 2, next_idx[1])};
    const RecordAt nw_mine[2] = {mine(nw[0], t + 2), mine(nw[1], t + 2)};  // V4.1 only
    const bool cur_f1 = pick.format<F0, F1>(t) != F0, next_f1 = pick.format<F0, F1>(t + 2) != F0;
    const bool valid[2] = {raw.valid[0], raw.valid[1]};
    // ---- S^T = K.Q^T: block by block, the A fragments dequantized from the registers ---------
    float s[8];
    uint32_t a[2][4][4];  // two blocks' fragments in flight: [block & 1][k-step][fragment]
#pragma unroll
    for (int blk = 0; blk < 8; ++blk) {
      if (blk >= 2) wgmma_wait<1>();  // block blk - 2's products have read their fragments
      uint32_t(&af)[4][4] = a[blk & 1];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        uint32_t h[8];  // the 16 values in natural order: h[2k] = physical 4k, 4k+1; h[2k+1] = 4k+2, 4k+3
        if constexpr (F0 != kFmtV4) {
          if (cur_f1) v41_block_values<F1>(raw, r, blk, ex_shift, sel, s_odd[r], h);
          else v41_block_values<F0>(raw, r, blk, ex_shift, sel, s_odd[r], h);
        } else if (blk < 7) {
          uint4 lo, hi;
          dequant_e4m3x16(raw.d[r][blk], scale_exponent(raw.ex[r].x, raw.ex[r].y, blk), lo, hi);
          h[0] = lo.x, h[1] = lo.y, h[2] = lo.z, h[3] = lo.w, h[4] = hi.x, h[5] = hi.y, h[6] = hi.z, h[7] = hi.w;
        } else {
          const uint4 x = bf16x8_to_f16(raw.d[r][7]), y = bf16x8_to_f16(raw.d[r][8]);
          h[0] = x.x, h[1] = x.y, h[2] = x.z, h[3] = x.w, h[4] = y.x, h[5] = y.y, h[6] = y.z, h[7] = y.w;
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) af[k][r] = h[2 * k], af[k][2 + r] = h[2 * k + 1];
        const int row = row0 + 8 * r;
        *reinterpret_cast<uint4*>(v_s + blk * kTBox + swizzled(row, 2 * q4)) = make_uint4(h[0], h[1], h[2], h[3]);
        *reinterpret_cast<uint4*>(v_s + blk * kTBox + swizzled(row, 2 * q4 + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
      }
      // This block's pieces of the next tile, into the registers just read.
      if constexpr (F0 != kFmtV4) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (next_f1) load_v41_block<F1>(raw, r, blk, nw_mine[r], nw[r]);
          else load_v41_block<F0>(raw, r, blk, nw_mine[r], nw[r]);
        }
      } else if (blk < 7) {
        raw.d[0][blk] = load_piece(nw[0], blk), raw.d[1][blk] = load_piece(nw[1], blk);
      } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) raw.d[r][7] = load_piece(nw[r], 7), raw.d[r][8] = load_piece(nw[r], 8);
      }
      if (F0 == kFmtV4 && blk == 6) raw.ex[0] = record_scales(nw[0]), raw.ex[1] = record_scales(nw[1]);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint64_t dq = make_desc(desc_lo(q_base + blk * kQBox16 + 32 * k, 16), 1024, kSwizzle128);
        wgmma_m64n16k16_f16_rs(s, af[k], dq, blk | k);
      }
      wgmma_commit();
    }
    wgmma_wait<0>();
    fence_regs(s);
    raw.valid[0] = nw[0].data != nullptr, raw.valid[1] = nw[1].data != nullptr;
    next_idx[0] = pick.index(t + 4, row0, kTT), next_idx[1] = pick.index(t + 4, row0 + 8, kTT);

    // ---- softmax over this tile's records, per head (a column) -----------------------------
    // s[4j + 2i + e]: record row0 + 8i, head 8j + 2q4 + e.
    // An entry tile's scores are 2^-7 short (its K * 2^-7): scaled back here, and its P taken 2^7 up.
    constexpr bool kEntries = F0 == kFmtEntry || F1 == kFmtEntry;
    const bool entry = kEntries && pick.format<F0, F1>(t) == kFmtEntry;
    const float score_scale = entry ? p.scale_log2 * kEntryScoreScale : p.scale_log2;
    const float p_shift = entry ? kEntryShift : 0.f, sum_scale = entry ? kEntrySumScale : 1.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] = valid[(k >> 1) & 1] ? s[k] * score_scale : -INFINITY;
    float mw[2][2];
    bool pred = false;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float m = fmaxf(s[4 * j + e], s[4 * j + 2 + e]);
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
        mw[j][e] = m;
        pred |= m > m_ref[j][e] + kRescaleSlack;
      }
    if (named_barrier_any(bar0 + 1, 128, pred)) {  // rare: the warps' maxima, then the common move
      if (g == 0)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) xchg[warp * kHeadRows + 8 * j + 2 * q4 + e] = mw[j][e];
      named_barrier_sync(bar0 + 2, 128);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int head = 8 * j + 2 * q4 + e;
          const float m = fmaxf(fmaxf(xchg[head], xchg[kHeadRows + head]),
                                fmaxf(xchg[2 * kHeadRows + head], xchg[3 * kHeadRows + head]));
          if (m > m_ref[j][e] + kRescaleSlack) {
            const float alpha = exp2f(m_ref[j][e] - m);  // 0 from -inf: O and l are 0 then
            m_ref[j][e] = m;
            l_part[j][e] *= alpha;
#pragma unroll
            for (int mb = 0; mb < 8; ++mb) o[mb][4 * j + e] *= alpha, o[mb][4 * j + 2 + e] *= alpha;
          }
        }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float m_use = (m_ref[j][e] == -INFINITY ? 0.f : m_ref[j][e]) - p_shift;
        s[4 * j + e] = exp2f(s[4 * j + e] - m_use);
        s[4 * j + 2 + e] = exp2f(s[4 * j + 2 + e] - m_use);
        l_part[j][e] += (s[4 * j + e] + s[4 * j + 2 + e]) * sum_scale;
      }
    // P^T (heads x records) by stmatrix.trans: matrix mm = 2j + i is records row0 - g + 8i.. x heads 8j..
    {
      const uint32_t pr[4] = {pack_half2(s[0], s[1]), pack_half2(s[2], s[3]), pack_half2(s[4], s[5]),
                              pack_half2(s[6], s[7])};
      const int mm = lane >> 3;
      stmatrix_x4_trans(pt_base + swizzled(8 * (mm >> 1) + (lane & 7), 2 * warp + (mm & 1)), pr);
    }
    fence_async_shared();  // the tile and P^T are read by wgmma
    named_barrier_sync(bar0 + 3, 128);
    // ---- O^T += V^T.P^T: 8 blocks of 64 dims x 4 k-steps of 16 records ----------------------
    wgmma_fence();
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint64_t dv = make_desc(desc_lo(v_base + mb * kTBox + kk * 16 * 128, p.v_desc_lead), p.v_desc_stride,
                                      kSwizzle128);
        const uint64_t dp = make_desc(desc_lo(pt_base + 32 * kk, 16), 1024, kSwizzle128);
        wgmma_m64n16k16_f16_tnspa(o[mb], dv, dp, 1);
      }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < 8; ++mb) fence_regs(o[mb]);
  }

  // ---- merge warpgroup 1 into warpgroup 0 (two partial softmaxes), then the epilogue ----------
  float* dump = reinterpret_cast<float*>(smem + kSmV + kTTile);  // warpgroup 1's tile, free now
  if (wg == 1) {
    named_barrier_sync(bar0, 128);  // every warp's last P.V is done with the tile
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int k = 0; k < 8; ++k) dump[(8 * mb + k) * 128 + tw] = o[mb][k];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      dump[(64 + k) * 128 + tw] = m_ref[k >> 1][k & 1];
      dump[(68 + k) * 128 + tw] = l_part[k >> 1][k & 1];
    }
    named_barrier_sync(kBarMerge, 256);
    return;
  }
  named_barrier_sync(kBarMerge, 256);
  float factor_in[2][2];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int j = k >> 1, e = k & 1;
    const float m1 = dump[(64 + k) * 128 + tw], l1 = dump[(68 + k) * 128 + tw];
    const float m = fmaxf(m_ref[j][e], m1);
    const float f0 = m == -INFINITY ? 0.f : exp2f(m_ref[j][e] - m), f1 = m == -INFINITY ? 0.f : exp2f(m1 - m);
    m_ref[j][e] = m;
    l_part[j][e] = l_part[j][e] * f0 + l1 * f1;
    factor_in[j][e] = f1;
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int i = 0; i < 2; ++i) o[mb][4 * j + 2 * i + e] *= f0;
  }
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int k = 0; k < 8; ++k) o[mb][k] += dump[(8 * mb + k) * 128 + tw] * factor_in[k >> 2][k & 1];
  // Row sums: the 8 lane groups, then the 4 warps (through shared memory).
  float* sums = reinterpret_cast<float*>(smem + kSmX) + 4 * kHeadRows;  // warpgroup 1's maxima slot
  float factor[2][2];
  finish_rows<2, kHeadRows, kBarEpi>(p, sums, l_part, m_ref, factor, warp, g, q4, b, tq, bt, split);
  // O (heads x dims) through warpgroup 0's tile, then coalesced 16-byte rows out.
  float* stage = reinterpret_cast<float*>(v_s);
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int j = k >> 2, i = (k >> 1) & 1, e = k & 1;
      stage[(8 * j + 2 * q4 + e) * kStageRow + 64 * mb + row0 + 8 * i] = o[mb][k] * factor[j][e];
    }
  named_barrier_sync(kBarEpi, 128);
  store_rows<kHeadRows, kStageRow>(p, stage, tw, b, tq, bt, split);
}

template <int F0, int F1>
int launch_tokens(const SparseParams* p, cudaStream_t stream) {
  static bool configured = false;
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(v4_sparse_decode_tokens_kernel<F0, F1>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, kSmTokBytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  const dim3 grid(1, p->batch * p->s_q, p->num_splits);
  v4_sparse_decode_tokens_kernel<F0, F1><<<grid, kTokThreads, kSmTokBytes, stream>>>(*p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// Up to 16 heads. fmt0 / fmt1: the record formats of scope 0 / 1 (kFmt*; the same twice for one
// scope): both V4, or each a V4.1 window row or entry. Returns a cudaError_t (0 = success), or -1
// for more heads or a format pair not built.
int v4_sparse_decode_tokens_sm90(const SparseParams* p, int fmt0, int fmt1, void* stream) {
  if (p->heads > kHeadRows) return -1;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (fmt0 == kFmtV4 && fmt1 == kFmtV4) return launch_tokens<kFmtV4, kFmtV4>(p, s);
  if (fmt0 == kFmtWindow && fmt1 == kFmtEntry) return launch_tokens<kFmtWindow, kFmtEntry>(p, s);
  if (fmt0 == kFmtWindow && fmt1 == kFmtWindow) return launch_tokens<kFmtWindow, kFmtWindow>(p, s);
  if (fmt0 == kFmtEntry && fmt1 == kFmtEntry) return launch_tokens<kFmtEntry, kFmtEntry>(p, s);
  if (fmt0 == kFmtEntry && fmt1 == kFmtWindow) return launch_tokens<kFmtEntry, kFmtWindow>(p, s);
  return -1;
}

int v4_sparse_decode_tokens_sm90_smem_bytes() { return kSmTokBytes; }

}  // extern "C"
