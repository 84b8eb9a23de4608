// DeepSeek-V4 / V4.1 sparse decode for up to 16 heads per GPU, "tokens2" (variant v3): the
// tokens-major design of v4_sparse_decode_tokens_sm90a.cu (records on wgmma's M side, each record
// loaded into registers one tile ahead and dequantized once into the A fragments of S^T = K.Q^T
// and into the warpgroup's fp16 tile; two warpgroups on alternate 64-record tiles, merged at the
// end as two partial softmaxes) with a tile loop built for its pace. Same contract, record formats
// and split-KV partials; the Python side is kernels/v4_sparse_decode_cuda.py, the design and its
// budget benchmarks/KERNEL_NOTES.md.
//
// - O^T += V^T.P^T on mma.sync (m16n8k16): warp w keeps O^T for dims 128w.. of every head (64
//   registers at 16 heads), V^T by ldmatrix.trans from the fp16 tile, P^T by ldmatrix. Only Q
//   (stored once) is read by the async proxy, so the loop has no fence.proxy.async (a
//   MEMBAR.ALL.CTA) while the next tile's loads are in flight.
// - kRows = 8 query rows (m64n8 Q.K^T, one n-tile of P.V) up to 8 heads, else 16.
// - Loads without branches: a missing record reads kZeroRecord (zeros are 0 in every format);
//   16-byte pieces, or pairs of 8 where a scope's pages are on 8 bytes only (kWide); a thread's
//   bytes at immediate offsets from one pointer per record.
// - The fp16 tile in rows of 1040 bytes (a record's 512 values + 16): the stores and the ldmatrix
//   are conflict-free, and every ldmatrix address is one register plus an immediate.
// - Q.K^T descriptors: one base plus an immediate per k-step.
// - Two barriers per tile: the top (every warp's last P.V has read the tile and P^T) and one
//   bar.red.or that publishes the tile and P^T and says whether any head's reference maximum must
//   move; P is computed with the current references first and recomputed on that rare move.

#include "v4_sparse_decode_tokens_common.cuh"

namespace {

constexpr int kT2Records = 64;                      // records per tile (wgmma M)
constexpr int kT2Threads = 256;                     // two warpgroups on alternate tiles
constexpr int kT2Row = 1040;                        // bytes per record row of the fp16 tile
constexpr int kT2Tile = kT2Records * kT2Row;        // 66,560
constexpr int kT2PtRow = 144;                       // bytes per head row of P^T (64 records + 16)
constexpr int kT2StageRow = 516;                    // floats per head row of the epilogue's staging
constexpr int kT2BarMerge = 7, kT2BarEpi = 8;       // per warpgroup w: 1 + 3w top, + 1 publish, + 2 exchange
// Timing diagnostics (V4 records in pages on 16 bytes only; the bench's cuda_v3_* arms):
// kDiagNoPrefetch drops the L2 prefetches; kDiagFence drops them too and puts the tokens kernel's
// fence.proxy.async back into the loop (before the publishing barrier, with the next tile's HBM
// loads in flight, as there); kDiagNoHbm reads every record from kZeroRecord through L1 (every SM
// its own copy: the loop's pace without HBM; wrong numbers).
constexpr int kDiagNone = 0, kDiagFence = 1, kDiagNoHbm = 2, kDiagNoPrefetch = 3;

__device__ __align__(16) uint8_t kZeroRecord[1024];  // what a missing record reads

template <int kRows>
struct T2Plan {
  static constexpr int kJ = kRows / 8;                   // n-tiles of 8 heads
  static constexpr int kQBox = kRows * 128;              // Q: 8 swizzled boxes of kRows x 64 dims
  static constexpr int kQ = 0;
  static constexpr int kV = kQ + 8 * kQBox;              // one fp16 tile per warpgroup
  static constexpr int kPt = kV + 2 * kT2Tile;           // one P^T per warpgroup
  static constexpr int kX = kPt + 2 * kRows * kT2PtRow;  // per warpgroup: 4 warps x kRows column maxima
  static constexpr int kBytes = kX + 2 * 4 * kRows * 4 + 1024;
  static_assert(kBytes <= 227 * 1024, "shared memory plan exceeds the SM's 227 KB");
  static_assert(kRows * kT2StageRow * 4 <= kT2Tile, "the epilogue's staging must fit in a tile");
  static_assert((8 * kJ * 4 + 8) * 128 * 4 <= kT2Tile, "warpgroup 1's state must fit in its tile");
};

__device__ __forceinline__ void qk_wgmma(float (&s)[8], const uint32_t (&a)[4], uint64_t d, int acc) {
  wgmma_m64n16k16_f16_rs(s, a, d, acc);
}
__device__ __forceinline__ void qk_wgmma(float (&s)[4], const uint32_t (&a)[4], uint64_t d, int acc) {
  wgmma_m64n8k16_f16_rs(s, a, d, acc);
}

// Where a thread reads a record: `mine` = its bytes of block 0 (16 q4 into a V4 data row or a
// window row, 8 q4 into an entry), `aux` = V4: the 8 scale bytes; V4.1: the record's scales.
struct RecordRef {
  const uint8_t* mine;
  const uint8_t* aux;
};

// Record `rec` of tile t (-1: none -> the zero record), without a branch: the scope's page of it
// by a multiply-high, its format's layout.
template <int F0, int F1, int kDiag = kDiagNone>
__device__ __forceinline__ RecordRef locate_ref(const SparseParams& p, const RecordPicker& pick, int t, int rec, int q4) {
  if constexpr (kDiag == kDiagNoHbm) rec = -1;
  const int sc = pick.tile0 + t < pick.tiles0 ? 0 : 1;
  const SparseScope& s = p.scope[sc];
  const int r = max(rec, 0);
  const int page = sc ? pick.div1(r) : pick.div0(r), slot = r - page * s.page_size;
  const uint8_t* base = s.cache + page * s.page_stride;
  if constexpr (F0 == kFmtV4) {
    static_assert(F1 == kFmtV4, "a call reads V4 records or V4.1 records, not both");
    const uint8_t* data = base + slot * kDataBytes;
    const uint8_t* scales = base + static_cast<long long>(s.page_size) * kDataBytes + slot * 8;
    return {rec < 0 ? kZeroRecord + 16 * q4 : data + 16 * q4, rec < 0 ? kZeroRecord : scales};
  } else {
    const int f = pick.format<F0, F1>(t);
    const uint8_t* data = rec < 0 ? kZeroRecord : base + slot * v41_record_bytes(f);
    return {data + (f == kFmtWindow ? 16 : 8) * q4, data + v41_value_bytes(f)};
  }
}

// 16 bytes of a record; kCached (the no-HBM diagnostic): through L1, which then holds kZeroRecord.
template <bool kWide, bool kCached = false>
__device__ __forceinline__ uint4 piece16(const uint8_t* p) {
  if constexpr (kCached) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
  } else if constexpr (kWide) {
    return ld_nc_16(p);
  } else {
    const uint2 lo = ld_nc_8_no_l1(p), hi = ld_nc_8_no_l1(p + 8);
    return make_uint4(lo.x, lo.y, hi.x, hi.y);
  }
}

// Block blk's pieces of the next tile's record r (format F) into the registers block blk of the
// current tile has just left (the layout of TwoRecords). rope_off: V4's RoPE bytes of this thread
// (448 + 16 q4 past `mine`).
template <int F, bool kWide, bool kCached = false>
__device__ __forceinline__ void load_block(TwoRecords& raw, int r, int blk, const RecordRef& at, int rope_off) {
  if constexpr (F == kFmtV4) {
    if (blk < 7) {
      raw.d[r][blk] = piece16<kWide, kCached>(at.mine + 64 * blk);
    } else {
      raw.d[r][7] = piece16<kWide, kCached>(at.mine + rope_off);
      raw.d[r][8] = piece16<kWide, kCached>(at.mine + rope_off + 16);
    }
    if (blk == 6) raw.ex[r] = ld_nc_8(at.aux);
  } else if constexpr (F == kFmtWindow) {
    raw.d[r][blk] = piece16<kWide>(at.mine + 64 * blk);
    if (blk == 7) raw.d[r][8] = piece16<kWide>(at.aux);
  } else {
    const uint2 v = ld_nc_8_no_l1(at.mine + 32 * blk);
    raw.d[r][blk].x = v.x, raw.d[r][blk].y = v.y;
    if (blk & 1) {
      const uint2 sc = ld_nc_8(at.aux + 4 * (blk - 1));
      raw.d[r][blk].z = sc.x, raw.d[r][blk].w = sc.y;
    }
  }
}

// An L2 prefetch of every piece load_block<F> will read of a record (ptxas issues those loads
// late, next to the last block's products; these make them L2 hits and keep a whole tile of HBM
// reads in flight from the top of the iteration).
template <int F>
__device__ __forceinline__ void prefetch_record(const RecordRef& at, int rope_off) {
  if constexpr (F == kFmtEntry) {
#pragma unroll
    for (int blk = 0; blk < 8; ++blk) prefetch_l2(at.mine + 32 * blk);
    prefetch_l2(at.aux);
  } else {
#pragma unroll
    for (int blk = 0; blk < 7; ++blk) prefetch_l2(at.mine + 64 * blk);
    prefetch_l2(at.mine + (F == kFmtV4 ? rope_off : 448));
    if constexpr (F == kFmtV4) prefetch_l2(at.mine + rope_off + 16);
    prefetch_l2(at.aux);
  }
}

// Record r's 16 values of block blk of the current tile (format F) as fp16 pairs in natural order.
template <int F>
__device__ __forceinline__ void block_values(const TwoRecords& raw, int r, int blk, uint32_t ex_shift, uint32_t sel,
                                             __half2& s_odd, uint32_t (&h)[8]) {
  if constexpr (F == kFmtV4) {
    uint4 lo, hi;
    if (blk < 7) {
      dequant_e4m3x16(raw.d[r][blk], scale_exponent(raw.ex[r].x, raw.ex[r].y, blk), lo, hi);
    } else {
      lo = bf16x8_to_f16(raw.d[r][7]);
      hi = bf16x8_to_f16(raw.d[r][8]);
    }
    h[0] = lo.x, h[1] = lo.y, h[2] = lo.z, h[3] = lo.w, h[4] = hi.x, h[5] = hi.y, h[6] = hi.z, h[7] = hi.w;
  } else {
    v41_block_values<F>(raw, r, blk, ex_shift, sel, s_odd, h);
  }
}

// P = 2^(s - m_ref + shift) for the thread's records (s[4j + 2i + e]: record row0 + 8i, head
// 8j + 2q4 + e), packed as fp16 pairs pr[2j + i], and its two records' sums per head.
template <int kJ>
__device__ __forceinline__ void exp_pack(const float (&s)[4 * kJ], const float (&m_ref)[kJ][2], float shift,
                                         uint32_t (&pr)[2 * kJ], float (&sum)[kJ][2]) {
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    float pv[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float m_use = (m_ref[j][e] == -INFINITY ? 0.f : m_ref[j][e]) - shift;
      pv[e] = exp2f(s[4 * j + e] - m_use);
      pv[2 + e] = exp2f(s[4 * j + 2 + e] - m_use);
      sum[j][e] = pv[e] + pv[2 + e];
    }
    pr[2 * j] = pack_half2(pv[0], pv[1]);
    pr[2 * j + 1] = pack_half2(pv[2], pv[3]);
  }
}

// P^T (heads x records, rows of kT2PtRow bytes) by stmatrix.trans: matrix 2j + i is records
// 16 warp + 8i.. x heads 8j.. (`addr`: this lane's row of it).
template <int kJ>
__device__ __forceinline__ void store_pt(uint32_t addr, const uint32_t (&pr)[2 * kJ]) {
  if constexpr (kJ == 2) stmatrix_x4_trans(addr, pr);
  else stmatrix_x2_trans(addr, pr[0], pr[1]);
}

template <int kRows, int F0, int F1, bool kWide, int kDiag>
__global__ void __launch_bounds__(kT2Threads, 1) v4_sparse_decode_tokens2_kernel(const __grid_constant__ SparseParams p) {
  using Plan = T2Plan<kRows>;
  constexpr int kJ = Plan::kJ;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int tw = tid & 127, warp = tw >> 5, lane = tid & 31, g = lane >> 2, q4 = lane & 3;
  const int bt = blockIdx.y, split = blockIdx.z;
  const int b = bt / p.s_q, tq = bt % p.s_q;
  const CtaTiles tiles(p, split);
  const int n = tiles.n;
  const RecordPicker pick(p, tiles, b, tq);
  const int row0 = 16 * warp + g;  // this thread's records row0, row0 + 8 of each of its tiles
  // The prologue's loads together: this thread's first indices, its Q chunks, then (below) its
  // first tile's records; Q reaches shared memory after they are all issued.
  const int idx0[2] = {pick.index(wg, row0, kT2Records), pick.index(wg, row0 + 8, kT2Records)};
  int next_idx[2] = {pick.index(wg + 2, row0, kT2Records), pick.index(wg + 2, row0 + 8, kT2Records)};
  QPermChunks<kRows, kT2Threads> q_chunks;
  q_chunks.load(p, b, tq, tid);

  uint8_t* v_s = smem + Plan::kV + wg * kT2Tile;
  float* xchg = reinterpret_cast<float*>(smem + Plan::kX) + wg * 4 * kRows;
  const uint32_t v_base = smem_addr(v_s), pt_base = smem_addr(smem + Plan::kPt + wg * kRows * kT2PtRow);
  const uint32_t q_lo = desc_lo(smem_addr(smem + Plan::kQ), 16);
  const int bar_top = 1 + 3 * wg, bar_pub = bar_top + 1, bar_x = bar_top + 2;
  // This thread's stores of its records (dims 16 q4.. of block 0), its ldmatrix rows of V^T
  // (records (lane >> 4) 8 + (lane & 7), dims 128 warp + 8 ((lane >> 3) & 1)) and of P^T, and its
  // stmatrix row of P^T.
  uint8_t* my_row = v_s + row0 * kT2Row + 32 * q4;
  const uint32_t v_lane = v_base + ((lane >> 4) * 8 + (lane & 7)) * kT2Row + ((lane >> 3) & 1) * 16 + 256 * warp;
  const uint32_t pt_lane = kJ == 2 ? pt_base + (8 * (lane >> 4) + (lane & 7)) * kT2PtRow + ((lane >> 3) & 1) * 16
                                   : pt_base + (lane & 7) * kT2PtRow + (lane >> 3) * 16;
  const uint32_t pt_st = pt_base + (8 * (lane >> 4) + (lane & 7)) * kT2PtRow + (2 * warp + ((lane >> 3) & 1)) * 16;
  const int rope_off = 448 + 16 * q4;
  const uint32_t ex_shift = 8 * (q4 >> 1), sel = static_cast<uint32_t>(q4) | static_cast<uint32_t>(4 + q4) << 4;

  float o[8][kJ][4];  // O^T: dims 128 warp + 16 mt + g + 8 (c >> 1), heads 8 nt + 2q4 + (c & 1) at o[mt][nt][c]
#pragma unroll
  for (int mt = 0; mt < 8; ++mt)
#pragma unroll
    for (int nt = 0; nt < kJ; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[mt][nt][c] = 0.f;
  float m_ref[kJ][2], l_part[kJ][2];
#pragma unroll
  for (int j = 0; j < kJ; ++j) m_ref[j][0] = m_ref[j][1] = -INFINITY, l_part[j][0] = l_part[j][1] = 0.f;
  __half2 s_odd[2];

  TwoRecords raw;
  {
    const RecordRef at[2] = {locate_ref<F0, F1, kDiag>(p, pick, wg, idx0[0], q4),
                             locate_ref<F0, F1, kDiag>(p, pick, wg, idx0[1], q4)};
    const bool f1 = pick.format<F0, F1>(wg) != F0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      raw.valid[r] = idx0[r] >= 0;
#pragma unroll
      for (int blk = 0; blk < 8; ++blk) {
        if (f1) load_block<F1, kWide, kDiag == kDiagNoHbm>(raw, r, blk, at[r], rope_off);
        else load_block<F0, kWide, kDiag == kDiagNoHbm>(raw, r, blk, at[r], rope_off);
      }
    }
  }
  q_chunks.store(smem + Plan::kQ, tid);
  fence_async_shared();  // Q is read by wgmma
  __syncthreads();

  for (int t = wg; t < n; t += 2) {
    if (t >= 2) named_barrier_sync(bar_top, 128);  // every warp's last P.V has read the tile and P^T
    const RecordRef nw[2] = {locate_ref<F0, F1, kDiag>(p, pick, t + 2, next_idx[0], q4),
                             locate_ref<F0, F1, kDiag>(p, pick, t + 2, next_idx[1], q4)};
    const bool valid[2] = {raw.valid[0], raw.valid[1]};  // this tile's records
    raw.valid[0] = next_idx[0] >= 0, raw.valid[1] = next_idx[1] >= 0;
    // Tile t + 4's indices, a whole iteration ahead of its locate.
    next_idx[0] = pick.index(t + 4, row0, kT2Records), next_idx[1] = pick.index(t + 4, row0 + 8, kT2Records);
    const bool cur_f1 = pick.format<F0, F1>(t) != F0, next_f1 = pick.format<F0, F1>(t + 2) != F0;
    if constexpr (kDiag == kDiagNone) {
      if (t + 2 < n) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (next_f1) prefetch_record<F1>(nw[r], rope_off);
          else prefetch_record<F0>(nw[r], rope_off);
        }
      }
    }
    // ---- S^T = K.Q^T block by block, A fragments dequantized from the registers -------------
    float s[4 * kJ];
    uint32_t af[4][4];  // one block's fragments: [k-step][fragment]
#pragma unroll
    for (int blk = 0; blk < 8; ++blk) {
      uint32_t h[2][8];  // record r's h[r][2k] = physical dims 4k, 4k+1 of the thread's 16; h[r][2k+1] = 4k+2, 4k+3
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (cur_f1) block_values<F1>(raw, r, blk, ex_shift, sel, s_odd[r], h[r]);
        else block_values<F0>(raw, r, blk, ex_shift, sel, s_odd[r], h[r]);
        uint8_t* dst = my_row + 8 * r * kT2Row + 128 * blk;
        *reinterpret_cast<uint4*>(dst) = make_uint4(h[r][0], h[r][1], h[r][2], h[r][3]);
        *reinterpret_cast<uint4*>(dst + 16) = make_uint4(h[r][4], h[r][5], h[r][6], h[r][7]);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // this block's pieces of the next tile
        if (next_f1) load_block<F1, kWide, kDiag == kDiagNoHbm>(raw, r, blk, nw[r], rope_off);
        else load_block<F0, kWide, kDiag == kDiagNoHbm>(raw, r, blk, nw[r], rope_off);
      }
      if (blk >= 1) wgmma_wait<0>();  // block blk - 1's products have read their fragments
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int r = 0; r < 2; ++r) af[k][r] = h[r][2 * k], af[k][2 + r] = h[r][2 * k + 1];
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k)
        qk_wgmma(s, af[k], make_desc(q_lo + ((blk * Plan::kQBox + 32 * k) >> 4), 1024, kSwizzle128), blk | k);
      wgmma_commit();
    }
    wgmma_wait<0>();
    fence_regs(s);

    // ---- softmax over this tile's records, per head (a column of S^T) -------------------------
    // An entry tile's scores are 2^-7 short (its K * 2^-7): scaled back here, and its P taken 2^7 up.
    constexpr bool kEntries = F0 == kFmtEntry || F1 == kFmtEntry;
    const bool entry = kEntries && pick.format<F0, F1>(t) == kFmtEntry;
    const float score_scale = entry ? p.scale_log2 * kEntryScoreScale : p.scale_log2;
    const float p_shift = entry ? kEntryShift : 0.f, sum_scale = entry ? kEntrySumScale : 1.f;
#pragma unroll
    for (int k = 0; k < 4 * kJ; ++k) s[k] = valid[(k >> 1) & 1] ? s[k] * score_scale : -INFINITY;
    float mw[kJ][2];
    bool pred = false;
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float m = fmaxf(s[4 * j + e], s[4 * j + 2 + e]);
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
        mw[j][e] = m;
        pred |= m > m_ref[j][e] + kRescaleSlack;
      }
    uint32_t pr[2 * kJ];
    float sum[kJ][2];
    exp_pack<kJ>(s, m_ref, p_shift, pr, sum);  // with the current references: the common case
    store_pt<kJ>(pt_st, pr);
    if constexpr (kDiag == kDiagFence) fence_async_shared();
    if (named_barrier_any(bar_pub, 128, pred)) {  // rare: the warps' maxima, the common move, P again
      if (g == 0)
#pragma unroll
        for (int j = 0; j < kJ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) xchg[warp * kRows + 8 * j + 2 * q4 + e] = mw[j][e];
      named_barrier_sync(bar_x, 128);
#pragma unroll
      for (int j = 0; j < kJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int head = 8 * j + 2 * q4 + e;
          const float m = fmaxf(fmaxf(xchg[head], xchg[kRows + head]), fmaxf(xchg[2 * kRows + head], xchg[3 * kRows + head]));
          if (m > m_ref[j][e] + kRescaleSlack) {
            const float alpha = exp2f(m_ref[j][e] - m);  // 0 from -inf: O and l are 0 then
            m_ref[j][e] = m;
            l_part[j][e] *= alpha;
#pragma unroll
            for (int mt = 0; mt < 8; ++mt) o[mt][j][e] *= alpha, o[mt][j][2 + e] *= alpha;
          }
        }
      exp_pack<kJ>(s, m_ref, p_shift, pr, sum);
      store_pt<kJ>(pt_st, pr);
      named_barrier_sync(bar_x, 128);  // the maxima read, P^T rewritten
    }
#pragma unroll
    for (int j = 0; j < kJ; ++j) l_part[j][0] += sum[j][0] * sum_scale, l_part[j][1] += sum[j][1] * sum_scale;

    // ---- O^T += V^T.P^T: 8 m-tiles of 16 dims x kJ n-tiles x 4 k-steps of 16 records ----------
    uint32_t pb[4][2 * kJ];  // k-step ks, n-tile nt: records 16ks + 2q4.. (b0) and + 8 (b1) of head 8nt + g
    if constexpr (kJ == 2) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) ldmatrix_x4(pt_lane + 32 * ks, pb[ks]);
    } else {
#pragma unroll
      for (int ks = 0; ks < 4; ks += 2) {
        uint32_t r4[4];
        ldmatrix_x4(pt_lane + 32 * ks, r4);
        pb[ks][0] = r4[0], pb[ks][1] = r4[1], pb[ks + 1][0] = r4[2], pb[ks + 1][1] = r4[3];
      }
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int mt = 0; mt < 8; ++mt) {
        uint32_t va[4];  // V^T rows dims 16 mt + g (+8), k = records 16 ks + 2q4.. (+8)
        ldmatrix_x4_trans(v_lane + ks * 16 * kT2Row + 32 * mt, va);
#pragma unroll
        for (int nt = 0; nt < kJ; ++nt) mma_16816(o[mt][nt], va, pb[ks][2 * nt], pb[ks][2 * nt + 1]);
      }
  }

  // ---- merge warpgroup 1 into warpgroup 0 (two partial softmaxes), then the epilogue ----------
  float* dump = reinterpret_cast<float*>(smem + Plan::kV + kT2Tile);  // warpgroup 1's tile, free now
  constexpr int kO = 8 * kJ * 4;                                     // O^T values per thread
  if (wg == 1) {
    named_barrier_sync(bar_top, 128);  // every warp's last P.V is done with the tile
#pragma unroll
    for (int mt = 0; mt < 8; ++mt)
#pragma unroll
      for (int nt = 0; nt < kJ; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) dump[((mt * kJ + nt) * 4 + c) * 128 + tw] = o[mt][nt][c];
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        dump[(kO + 2 * j + e) * 128 + tw] = m_ref[j][e];
        dump[(kO + 4 + 2 * j + e) * 128 + tw] = l_part[j][e];
      }
    named_barrier_sync(kT2BarMerge, 256);
    return;
  }
  named_barrier_sync(kT2BarMerge, 256);
  float factor_in[kJ][2];
#pragma unroll
  for (int j = 0; j < kJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float m1 = dump[(kO + 2 * j + e) * 128 + tw], l1 = dump[(kO + 4 + 2 * j + e) * 128 + tw];
      const float m = fmaxf(m_ref[j][e], m1);
      const float f0 = m == -INFINITY ? 0.f : exp2f(m_ref[j][e] - m), f1 = m == -INFINITY ? 0.f : exp2f(m1 - m);
      m_ref[j][e] = m;
      l_part[j][e] = l_part[j][e] * f0 + l1 * f1;
      factor_in[j][e] = f1;
#pragma unroll
      for (int mt = 0; mt < 8; ++mt) o[mt][j][e] *= f0, o[mt][j][2 + e] *= f0;
    }
#pragma unroll
  for (int mt = 0; mt < 8; ++mt)
#pragma unroll
    for (int nt = 0; nt < kJ; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[mt][nt][c] += dump[((mt * kJ + nt) * 4 + c) * 128 + tw] * factor_in[nt][c & 1];
  // Row sums: the 8 lane groups, then the 4 warps (through shared memory).
  float* sums = reinterpret_cast<float*>(smem + Plan::kX) + 4 * kRows;  // warpgroup 1's maxima slot
  float factor[kJ][2];
  finish_rows<kJ, kRows, kT2BarEpi>(p, sums, l_part, m_ref, factor, warp, g, q4, b, tq, bt, split);
  // O (heads x dims) through warpgroup 0's tile, then coalesced 16-byte rows out.
  float* stage = reinterpret_cast<float*>(v_s);
#pragma unroll
  for (int mt = 0; mt < 8; ++mt)
#pragma unroll
    for (int nt = 0; nt < kJ; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int head = 8 * nt + 2 * q4 + (c & 1), dim = 128 * warp + 16 * mt + g + 8 * (c >> 1);
        stage[head * kT2StageRow + dim] = o[mt][nt][c] * factor[nt][c & 1];
      }
  named_barrier_sync(kT2BarEpi, 128);
  store_rows<kRows, kT2StageRow>(p, stage, tw, b, tq, bt, split);
}

template <int kRows, int F0, int F1, bool kWide, int kDiag = kDiagNone>
int launch_tokens2(const SparseParams* p, cudaStream_t stream) {
  static bool configured = false;
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(v4_sparse_decode_tokens2_kernel<kRows, F0, F1, kWide, kDiag>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, T2Plan<kRows>::kBytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  const dim3 grid(1, p->batch * p->s_q, p->num_splits);
  v4_sparse_decode_tokens2_kernel<kRows, F0, F1, kWide, kDiag><<<grid, kT2Threads, T2Plan<kRows>::kBytes, stream>>>(*p);
  return static_cast<int>(cudaGetLastError());
}

template <int kRows, bool kWide>
int launch_tokens2_formats(const SparseParams* p, int fmt0, int fmt1, int diag, cudaStream_t s) {
  if constexpr (kWide) {
    if (diag != kDiagNone && fmt0 == kFmtV4 && fmt1 == kFmtV4) {
      if (diag == kDiagFence) return launch_tokens2<kRows, kFmtV4, kFmtV4, true, kDiagFence>(p, s);
      if (diag == kDiagNoHbm) return launch_tokens2<kRows, kFmtV4, kFmtV4, true, kDiagNoHbm>(p, s);
      return launch_tokens2<kRows, kFmtV4, kFmtV4, true, kDiagNoPrefetch>(p, s);
    }
  }
  if (diag != kDiagNone) return -1;
  if (fmt0 == kFmtV4 && fmt1 == kFmtV4) return launch_tokens2<kRows, kFmtV4, kFmtV4, kWide>(p, s);
  if (fmt0 == kFmtWindow && fmt1 == kFmtEntry) return launch_tokens2<kRows, kFmtWindow, kFmtEntry, kWide>(p, s);
  if (fmt0 == kFmtWindow && fmt1 == kFmtWindow) return launch_tokens2<kRows, kFmtWindow, kFmtWindow, kWide>(p, s);
  if (fmt0 == kFmtEntry && fmt1 == kFmtEntry) return launch_tokens2<kRows, kFmtEntry, kFmtEntry, kWide>(p, s);
  if (fmt0 == kFmtEntry && fmt1 == kFmtWindow) return launch_tokens2<kRows, kFmtEntry, kFmtWindow, kWide>(p, s);
  return -1;
}

}  // namespace

extern "C" {

// Up to 16 heads (8 query rows up to 8 heads). fmt0 / fmt1: the record formats of scope 0 / 1
// (kFmt*; the same twice for one scope). 16-byte loads where every scope's pages start on 16
// bytes. diag: kDiag* (0 for the kernel itself). Returns a cudaError_t (0 = success), or -1 for
// more heads, a format pair not built or a diagnostic not built (V4.1 records, pages on 8 bytes).
int v4_sparse_decode_tokens2_sm90(const SparseParams* p, int fmt0, int fmt1, int diag, void* stream) {
  if (p->heads > 16 || diag < kDiagNone || diag > kDiagNoPrefetch) return -1;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  bool wide = true;
  for (int i = 0; i < p->num_scopes; ++i)
    wide = wide && ((static_cast<unsigned long long>(p->scope[i].page_stride) |
                     reinterpret_cast<uintptr_t>(p->scope[i].cache)) & 15) == 0;
  if (p->heads <= 8)
    return wide ? launch_tokens2_formats<8, true>(p, fmt0, fmt1, diag, s)
                : launch_tokens2_formats<8, false>(p, fmt0, fmt1, diag, s);
  return wide ? launch_tokens2_formats<16, true>(p, fmt0, fmt1, diag, s)
              : launch_tokens2_formats<16, false>(p, fmt0, fmt1, diag, s);
}

// Shared memory of a CTA for `heads` heads (-1 above 16).
int v4_sparse_decode_tokens2_sm90_smem_bytes(int heads) {
  return heads <= 8 ? T2Plan<8>::kBytes : heads <= 16 ? T2Plan<16>::kBytes : -1;
}

}  // extern "C"
