// DeepSeek-V4 sparse decode, second design for 64+ heads (the "v2" variant of
// kernels/v4_sparse_decode_cuda.py): 64-record tiles, one warpgroup computes all of Q.K^T, and at
// 65-128 heads a 2-CTA cluster dequantizes each record once for both head blocks. Same contract,
// records and split-KV partials as v4_sparse_decode_sm90a.cu (the first design, kept beside it);
// why this shape, the budget and the cost model: benchmarks/KERNEL_NOTES.md.
//
// - A CTA = one query token x 64 heads x one split of the token's 64-record tiles (the window
//   scope's tiles, then the selected entries'); 384 threads, one CTA per SM.
// - Warpgroup 0 produces: each thread loads its records' 16-byte chunks straight into registers
//   (ld.global.nc, two units of 32 records in flight), dequantizes them (e4m3 pair -> f16x2, times
//   the power-of-two scale; RoPE bf16 -> fp16) into the fp16 tile in wgmma's 128-byte-swizzled
//   layout (two stages of 64 KB), writes each record's score bias (0, or -inf for a record the
//   indices leave out; its data is written as zeros) and arrives on the stage's `full` mbarrier.
//   With a cluster (two head blocks of one token), each CTA's producer converts half of every
//   tile and writes it into both CTAs' stages (st.async into the peer, completing the peer's
//   `full` transaction count): every record is gathered and dequantized once per 128 heads.
// - Warpgroup 1 (the lead) computes S = Q.K^T for all 64 records of a tile (32 x m64n64k16, Q and K
//   from shared memory: Q is read once per tile), the fp32 online softmax in log2 units with a
//   lazy reference maximum (moves only past 2^8), publishes P (fp16, stmatrix) and per-warp rescale
//   factors in one of two P buffers, then O[:, 0:256] += P.V (m64n256k16, P from registers,
//   V = the same tile read N-major).
// - Warpgroup 2 takes the published P and runs O[:, 256:512] += P.V with P from shared memory.
// - A stage is refilled once all eight consumer warps (sixteen, both CTAs, in a cluster) have
//   waited for their last product on it. No wgmma is in flight across a loop's back edge.

#include "v4_sparse_decode_common.cuh"

namespace {

constexpr int kT = 64;               // records per tile
constexpr int kRows = 64;            // query rows per CTA (wgmma M)
constexpr int kT64Threads = 384;     // producer, lead consumer, P.V consumer
// Registers per thread after the hand-over (producer, lead, P.V warpgroup; 3 x 168 per thread at
// launch): the pair's producer also keeps the peer's addresses.
template <int kCluster>
struct T64Regs {
  static constexpr int kProducer = kCluster > 1 ? 136 : 112, kLead = kCluster > 1 ? 208 : 224;
  static constexpr int kPv = kCluster > 1 ? 160 : 168;  // 168: no hand-over
  static_assert(kProducer + kLead + kPv == 3 * 168, "the registers handed over must add up to the launch pool");
};
constexpr int kBox = kT * 128;       // 8192: one 64-dim box of a tile (a 128-byte row per record)
constexpr int kTileBytes = 8 * kBox;  // 65536
constexpr int kQBox = kRows * 128;
constexpr int kPBytes = kRows * 128;  // P: 64 rows x 64 records fp16, one swizzled box
constexpr int kStages = 2;
constexpr int kUnitRecords = 32;     // records one producer pass converts (4 threads per record)
// Bytes a peer writes into each stage of this CTA: 32 records of 1024 fp16 bytes and their biases.
constexpr uint32_t kPeerBytes = kUnitRecords * 1024 + kUnitRecords * 4;

constexpr int kSmemQ = 0;
constexpr int kSmemK = kSmemQ + 8 * kQBox;
constexpr int kSmemP = kSmemK + kStages * kTileBytes;
constexpr int kSmemBias = kSmemP + 2 * kPBytes;       // per stage and record: 0 or -inf
constexpr int kSmemAlpha = kSmemBias + kStages * kT * 4;  // per P buffer and row: the rescale factor
constexpr int kSmemFlags = kSmemAlpha + 2 * kRows * 4;    // per P buffer and warp: any row rescaled
constexpr int kSmemFactor = kSmemFlags + 2 * 4 * 4;      // per row: the epilogue's output factor
constexpr int kSmemBars = kSmemFactor + kRows * 4;       // full[2], empty[2]
constexpr int kSmemT64Bytes = kSmemBars + 2 * kStages * 8 + 1024;
static_assert(kSmemT64Bytes <= 227 * 1024, "shared memory plan exceeds the SM's 227 KB");

// Named barriers of the two consumer warpgroups (256 threads): P buffer b published / free again,
// the epilogue's factors written.
constexpr int kBarReady = 1, kBarFree = 3, kBarEpilogue = 5;

// A producer thread's share of 32 records: the 16-byte chunks (tid & 3) + 4m of record tid / 4 and
// its scale bytes, and whether the indices pick it. V4: chunks m < 9 in d[m], the 8 scale bytes in
// ex; V4.1 window: value chunks m < 8 in d[m], the 16 scale bytes in d[8]; V4.1 entry: the 8-byte
// pieces (tid & 3) + 4m, m < 8 (dims 64m + 16 (tid & 3).., the same fp16 slots as a window chunk m)
// in the halves of d[m / 2], the 32 scale bytes in d[4], d[5].
struct Unit {
  uint4 d[9];
  uint2 ex;
  bool valid;
};

// Loads a producer thread's share of a V4.1 record of format F (`part` = tid & 3).
template <int F>
__device__ __forceinline__ void fetch_share(const RecordAt& at, int part, Unit& x) {
  x.valid = at.data != nullptr;
  if constexpr (F == kFmtWindow) {
    const RecordAt mine = record_plus(at, 16 * part);
#pragma unroll
    for (int m = 0; m < 8; ++m) x.d[m] = record_bytes16(mine, 64 * m);
    x.d[8] = record_bytes16(at, 512);
  } else {
    const RecordAt mine = record_plus(at, 8 * part);
#pragma unroll
    for (int m = 0; m < 8; m += 2) {
      const uint2 a = record_bytes8(mine, 32 * m), b = record_bytes8(mine, 32 * (m + 1));
      x.d[m / 2] = make_uint4(a.x, a.y, b.x, b.y);
    }
    x.d[4] = record_bytes16(at, 256);
    x.d[5] = record_bytes16(at, 272);
  }
}

// Dequantizes a producer thread's share of a V4.1 record of format F into fp16 row `row` of stage st
// through put16(offset in the stage, 16 bytes, st).
template <int F, class Put>
__device__ __forceinline__ void convert_share(const Unit& x, int row, int part, int st, Put& put16) {
  if constexpr (F == kFmtWindow) {
    // Chunk part + 4m = dims 64m + 16part.. (box m, slots 2part, +1) under scale byte 2m + part / 2:
    // the thread's 8 scale bytes gathered into (lo, hi) as V4's per-64 exponents.
    const uint32_t sel = 0x6420u + 0x1111u * static_cast<uint32_t>(part >> 1);
    const uint32_t lo_ex = __byte_perm(x.d[8].x, x.d[8].y, sel), hi_ex = __byte_perm(x.d[8].z, x.d[8].w, sel);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      uint4 lo, hi;
      dequant_e4m3x16(x.d[m], scale_exponent(lo_ex, hi_ex, m), lo, hi);
      put16(m * kBox + swizzled(row, 2 * part), lo, st);
      put16(m * kBox + swizzled(row, 2 * part + 1), hi, st);
    }
  } else {
    // Piece m = 16 codes, dims 64m + 16part.. (box m, slots 2part, +1) under scale byte 4m + part:
    // byte `part` of scale words m and m + 1 for a pair of pieces.
    const uint32_t sw[8] = {x.d[4].x, x.d[4].y, x.d[4].z, x.d[4].w, x.d[5].x, x.d[5].y, x.d[5].z, x.d[5].w};
    const uint32_t sel = static_cast<uint32_t>(part) | static_cast<uint32_t>(4 + part) << 4;
#pragma unroll
    for (int m = 0; m < 8; m += 2) {
      const __half2 s2 = e4m3x2_scale_x128(__byte_perm(sw[m], sw[m + 1], sel));
      uint4 lo, hi;
      dequant_e2m1x16(x.d[m / 2].x, x.d[m / 2].y, __low2half2(s2), lo, hi);
      put16(m * kBox + swizzled(row, 2 * part), lo, st);
      put16(m * kBox + swizzled(row, 2 * part + 1), hi, st);
      dequant_e2m1x16(x.d[m / 2].z, x.d[m / 2].w, __high2half2(s2), lo, hi);
      put16((m + 1) * kBox + swizzled(row, 2 * part), lo, st);
      put16((m + 1) * kBox + swizzled(row, 2 * part + 1), hi, st);
    }
  }
}

// The producer warpgroup (tid 0..127). Unit u = half (u % 2) of tile u / 2, or with a cluster the
// rank's half of tile u; a ring of two units in registers, loads issued two units ahead, L2
// prefetches four units ahead. F0 / F1: the record formats of the two scopes.
template <int kCluster, int F0, int F1>
__device__ __forceinline__ void produce_t64(const SparseParams& p, const CtaTiles& tiles, int b, int tq, int tid,
                                            uint8_t* k_s, float* bias_s, uint32_t bar_full, uint32_t bar_empty,
                                            uint32_t rank) {
  constexpr int kUnitsPerTile = 2 / kCluster;
  const int n = tiles.n, units = n * kUnitsPerTile;
  const int r = tid >> 2, part = tid & 3;
  const RecordPicker pick(p, tiles, b, tq);
  auto row_of = [&](int u) { return kUnitRecords * (kCluster > 1 ? static_cast<int>(rank) : u % kUnitsPerTile) + r; };
  auto index_of = [&](int u) { return u < units ? pick.index(u / kUnitsPerTile, row_of(u), kT) : -1; };
  auto fetch = [&](int u, int rec, Unit& x) {
    if constexpr (F0 == kFmtV4) {
      const RecordAt at = pick.locate(u / kUnitsPerTile, rec);
      x.valid = at.data != nullptr;
#pragma unroll
      for (int m = 0; m < 9; ++m) x.d[m] = record_bytes16(at, 16 * (part + 4 * m));
      x.ex = record_scales(at);
    } else {
      const int t = u / kUnitsPerTile;
      const RecordAt at = pick.locate<F0, F1>(t, rec);
      if (pick.format<F0, F1>(t) == F0) fetch_share<F0>(at, part, x);
      else fetch_share<F1>(at, part, x);
    }
  };
  // The peer's copies of our stages, biases and `full` mbarriers (the shared::cluster window of a
  // CTA is contiguous: one mapa per base).
  const uint32_t peer = rank ^ 1;
  const uint32_t peer_k = kCluster > 1 ? peer_addr(smem_addr(k_s), peer) : 0;
  const uint32_t peer_bias = kCluster > 1 ? peer_addr(smem_addr(bias_s), peer) : 0;
  const uint32_t peer_full = kCluster > 1 ? peer_addr(bar_full, peer) : 0;
  auto put16 = [&](uint32_t off, uint4 v, int st) {  // off: from the stage's start
    *reinterpret_cast<uint4*>(k_s + st * kTileBytes + off) = v;
    if (kCluster > 1) st_async_v4(peer_k + st * kTileBytes + off, v, peer_full + 8 * st);
  };
  auto convert = [&](int u, const Unit& x) {
    const int t = u / kUnitsPerTile, st = t & 1, row = row_of(u);
    const bool first = kCluster > 1 || u % kUnitsPerTile == 0, last = kCluster > 1 || u % kUnitsPerTile == 1;
    if (first && t >= kStages) {
      mbar_wait_or_trap<(kCluster > 1)>(bar_empty + 8 * st, ((t / kStages) - 1) & 1);
    }
    if constexpr (F0 == kFmtV4) {
#pragma unroll
      for (int m = 0; m < 7; ++m) {  // e4m3 chunk part + 4m: dims 64m + 16part.., box m, slots 2part, +1
        uint4 lo, hi;
        dequant_e4m3x16(x.d[m], scale_exponent(x.ex.x, x.ex.y, m), lo, hi);
        put16(m * kBox + swizzled(row, 2 * part), lo, st);
        put16(m * kBox + swizzled(row, 2 * part + 1), hi, st);
      }
#pragma unroll
      for (int m = 7; m < 9; ++m)  // RoPE chunk part + 4(m - 7) of box 7
        put16(7 * kBox + swizzled(row, part + 4 * (m - 7)), bf16x8_to_f16(x.d[m]), st);
    } else if (pick.format<F0, F1>(t) == F0) {
      convert_share<F0>(x, row, part, st, put16);
    } else {
      convert_share<F1>(x, row, part, st, put16);
    }
    if (part == 0) {
      const float bias = x.valid ? 0.f : -INFINITY;
      bias_s[st * kT + row] = bias;
      if (kCluster > 1)
        st_async_b32(peer_bias + (st * kT + row) * 4, __float_as_uint(bias), peer_full + 8 * st);
    }
    if (last) {
      fence_async_shared();  // the fp16 tile is read by wgmma (the async proxy)
      if (kCluster > 1 && tid == 0) mbar_arm(bar_full + 8 * st, kPeerBytes);  // also waits for the peer's half
      else mbar_arrive(bar_full + 8 * st);
    }
  };
  // Unit u + 4's lines into L2 (two units beyond the registers' reach): the record's data lines
  // by its four threads, its scale bytes by a fifth.
  auto prefetch = [&](int u, int rec) {
    const int t = u / kUnitsPerTile;
    const RecordAt at = pick.locate<F0, F1>(t, rec);
    if (at.data == nullptr) return;
    if constexpr (F0 == kFmtV4) {
      prefetch_l2(at.data + 128 * part);
      if (part == 0) prefetch_l2(at.data + 512);
      if (part == 1) prefetch_l2(at.data + kDataBytes - 1);
      if (part == 2) prefetch_l2(at.scales);
    } else {  // the lines of bytes 128 part (within the record), 512 (window) and the last byte
      const int bytes = v41_record_bytes(pick.format<F0, F1>(t));
      prefetch_l2(at.data + min(128 * part, bytes - 1));
      if (part == 0 && bytes > 512) prefetch_l2(at.data + 512);
      if (part == 1) prefetch_l2(at.data + bytes - 1);
    }
  };
  Unit ra, rb;
  fetch(0, index_of(0), ra);
  fetch(1, index_of(1), rb);
  // Record numbers of units u + 2 .. u + 5 while unit u converts.
  int i2 = index_of(2), i3 = index_of(3), i4 = index_of(4), i5 = index_of(5);
  for (int u = 0; u < units; u += 2) {
    convert(u, ra);
    if (u + 2 < units) fetch(u + 2, i2, ra);
    prefetch(u + 4, i4);
    i2 = i4, i4 = index_of(u + 6);
    if (u + 1 < units) {
      convert(u + 1, rb);
      if (u + 3 < units) fetch(u + 3, i3, rb);
      prefetch(u + 5, i5);
      i3 = i5, i5 = index_of(u + 7);
    }
  }
}

// What both consumer warpgroups read.
struct ConsumerCtx {
  const SparseParams& p;
  int n, b, tq, bt, split, head_block, tid, tile0;  // tile0: the split's first tile of the token's
  uint32_t rank, bar_full, bar_empty, q_base, k_base, p_base;
  const float* bias_s;
  float* alpha_s;
  int* flags_s;
  float* factor_s;
};

// A consumer warp is done with stage st: one arrival here (and one at the peer's mbarrier).
template <int kCluster>
__device__ __forceinline__ void release_stage(const ConsumerCtx& x, int st, int lane) {
  __syncwarp();
  if (lane == 0) {
    mbar_arrive(x.bar_empty + 8 * st);
    if (kCluster > 1) mbar_arrive_remote(peer_addr(x.bar_empty + 8 * st, x.rank ^ 1));
  }
}

// Stage t % 2 holds tile t. With a cluster, the peer's half arrived by st.async: generic-proxy
// stores that complete asynchronously, so the peer's proxy fence (after issuing them) does not
// cover them. This thread's wgmma reads them through the async proxy: its own proxy fence, after
// the wait has acquired the stores, orders them.
template <int kCluster>
__device__ __forceinline__ void wait_full(const ConsumerCtx& x, int t) {
  mbar_wait_or_trap<(kCluster > 1)>(x.bar_full + 8 * (t & 1), (t >> 1) & 1);
  if (kCluster > 1) fence_async_shared();
}

// This warpgroup's half of O (dims 256c..) times the epilogue's row factors.
__device__ __forceinline__ void store_half(const ConsumerCtx& x, const float (&o)[128], int c, int warp, int g,
                                           int q4) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = 16 * warp + g + 8 * i, head = x.head_block * kRows + row;
    if (head < x.p.heads) store_row(x.p, o, i, x.factor_s[row], head, c, q4, x.b, x.tq, x.bt, x.split);
  }
}

// Warpgroup 1: Q.K^T, softmax, P, O[:, 0:256]. Entry tiles (F0 / F1 == kFmtEntry) hold K * 2^-7:
// their scores are scaled by 2^7 more, their P by 2^7 (kEntryShift), their row sums not.
template <int kCluster, int F0, int F1>
__device__ __forceinline__ void lead_consumer(const ConsumerCtx& x) {
  const SparseParams& p = x.p;
  const int tw = x.tid & 127, warp = tw >> 5, lane = x.tid & 31, g = lane >> 2, q4 = lane & 3;
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_ref[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const int mi = lane >> 3, prow = 16 * warp + 8 * (mi & 1) + (lane & 7);  // this lane's stmatrix row
  for (int t = 0; t < x.n; ++t) {
    const int st = t & 1, pb = t & 1;
    const uint32_t kt = x.k_base + st * kTileBytes;
    wait_full<kCluster>(x, t);
    float s[32];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 32; ++kk) {  // 16 dims per k-step: 32 bytes of a box row
      const int box = kk >> 2, off = (kk & 3) * 32;
      const uint64_t dq = make_desc(desc_lo(x.q_base + box * kQBox + off, 16), 1024, kSwizzle128);
      const uint64_t dk = make_desc(desc_lo(kt + box * kBox + off, 16), 1024, kSwizzle128);
      wgmma_m64n64k16_f16(s, dq, dk, kk);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
    // Scores in log2 units; rows 16 warp + g + 8i, records 8j + 2q4 + e at s[4j + 2i + e].
    constexpr bool kEntries = F0 == kFmtEntry || F1 == kFmtEntry;
    const bool entry = kEntries && (F0 == F1 ? F0 : (x.tile0 + t < p.scope[0].tiles ? F0 : F1)) == kFmtEntry;
    float mx[2];
    scale_and_row_max<8>(s, x.bias_s + st * kT, entry ? p.scale_log2 * kEntryScoreScale : p.scale_log2, q4, mx);
    const bool move[2] = {mx[0] > m_ref[0] + kRescaleSlack, mx[1] > m_ref[1] + kRescaleSlack};
    const bool warp_moves = __any_sync(0xffffffffu, move[0] || move[1]);
    if (t >= kStages) named_barrier_sync(kBarFree + pb, 256);  // warpgroup 2 is done with P buffer pb
    if (warp_moves) {  // O is not in flight here: its last P.V was waited for
      float alpha[2];
      move_reference(move, mx, m_ref, l_run, alpha);
      scale_rows(o, alpha[0], alpha[1]);
      if (q4 == 0) {
        x.alpha_s[pb * kRows + 16 * warp + g] = alpha[0];
        x.alpha_s[pb * kRows + 16 * warp + g + 8] = alpha[1];
      }
    }
    if (lane == 0) x.flags_s[pb * 4 + warp] = warp_moves;
    uint32_t a[4][4];
    exp_sum_pack<8>(s, m_ref, l_run, a, entry ? kEntryShift : 0.f, entry ? kEntrySumScale : 1.f);
    // P into buffer pb: fragment kk is the stmatrix of 8x8 matrices (rows 0-7 | 8-15) x (records
    // 16kk.. | 16kk+8..).
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) stmatrix_x4(x.p_base + pb * kPBytes + swizzled(prow, 2 * kk + (mi >> 1)), a[kk]);
    fence_async_shared();  // P is read by warpgroup 2's wgmma
    named_barrier_arrive(kBarReady + pb, 256);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // V rows of 16 records, boxes 0-3 (dims 0-255)
      const uint64_t dv = make_desc(desc_lo(kt + kk * 16 * 128, p.v_desc_lead), p.v_desc_stride, kSwizzle128);
      wgmma_m64n256k16_f16_rs_tnspb(o, a[kk], dv, 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
    release_stage<kCluster>(x, st, lane);
  }
  // Epilogue: the row sums give both warpgroups their factors.
  const bool split_kv = p.num_splits > 1;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = l_run[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = 16 * warp + g + 8 * i, head = x.head_block * kRows + row;
    const bool lonely = !(l > 0.f);
    const float lse = lonely ? -INFINITY : (m_ref[i] + log2f(l)) * kLn2;
    float factor = lonely ? 0.f : 1.f / l;
    if (!split_kv && p.sinks != nullptr && !lonely && head < p.heads) factor /= 1.f + expf(p.sinks[head] - lse);
    if (q4 == 0) {
      x.factor_s[row] = factor;
      if (head < p.heads) store_lse(p, head, lse, x.b, x.tq, x.bt, x.split);
    }
  }
  named_barrier_sync(kBarEpilogue, 256);
  store_half(x, o, 0, warp, g, q4);
  if (kCluster > 1) cluster_sync();
}

// Warpgroup 2: O[:, 256:512] += P.V with the lead's published P.
template <int kCluster>
__device__ __forceinline__ void pv_consumer(const ConsumerCtx& x) {
  const SparseParams& p = x.p;
  const int tw = x.tid & 127, warp = tw >> 5, lane = x.tid & 31, g = lane >> 2, q4 = lane & 3;
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  for (int t = 0; t < x.n; ++t) {
    const int st = t & 1, pb = t & 1;
    const uint32_t kt = x.k_base + st * kTileBytes;
    named_barrier_sync(kBarReady + pb, 256);
    wait_full<kCluster>(x, t);  // complete already (the lead waited for it); this warpgroup's own acquire and fence
    if (x.flags_s[pb * 4 + warp]) {
      scale_rows(o, x.alpha_s[pb * kRows + 16 * warp + g], x.alpha_s[pb * kRows + 16 * warp + g + 8]);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t da = make_desc(desc_lo(x.p_base + pb * kPBytes + kk * 32, 16), 1024, kSwizzle128);
      const uint64_t dv =
          make_desc(desc_lo(kt + 4 * kBox + kk * 16 * 128, p.v_desc_lead), p.v_desc_stride, kSwizzle128);
      wgmma_m64n256k16_f16_ss_tnspb(o, da, dv, 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
    release_stage<kCluster>(x, st, lane);
    if (t + kStages < x.n) named_barrier_arrive(kBarFree + pb, 256);  // the lead syncs it at t + 2
  }
  named_barrier_sync(kBarEpilogue, 256);
  store_half(x, o, 1, warp, g, q4);
  if (kCluster > 1) cluster_sync();
}

template <int kCluster, int F0, int F1>
__global__ void __launch_bounds__(kT64Threads, 1) v4_sparse_decode_t64_kernel(const __grid_constant__ SparseParams p) {
  extern __shared__ uint8_t smem_raw[];
  // Aligned by an offset from the __shared__ array, so that the compiler keeps st.shared / ld.shared.
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* q_s = smem + kSmemQ;
  uint8_t* k_s = smem + kSmemK;
  float* bias_s = reinterpret_cast<float*>(smem + kSmemBias);
  float* alpha_s = reinterpret_cast<float*>(smem + kSmemAlpha);
  int* flags_s = reinterpret_cast<int*>(smem + kSmemFlags);
  float* factor_s = reinterpret_cast<float*>(smem + kSmemFactor);
  const uint32_t bar_full = smem_addr(smem + kSmemBars), bar_empty = bar_full + 8 * kStages;

  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int head_block = blockIdx.x, bt = blockIdx.y, split = blockIdx.z;
  const int b = bt / p.s_q, tq = bt % p.s_q;
  const uint32_t rank = kCluster > 1 ? cluster_rank() : 0;
  const CtaTiles tiles(p, split);
  const int n = tiles.n;
  load_q_tile<kRows>(p, b, tq, head_block * kRows, q_s, tid, kT64Threads);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init_count(bar_full + 8 * s, 128);
      mbar_init_count(bar_empty + 8 * s, 8 * kCluster);  // lane 0 of each consumer warp (of both CTAs)
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  fence_async_shared();
  if (kCluster > 1) cluster_sync();  // the peer's mbarriers exist before anything reaches them
  else __syncthreads();

  using Regs = T64Regs<kCluster>;
  if (wg == 0) {
    setmaxnreg_dec<Regs::kProducer>();
    produce_t64<kCluster, F0, F1>(p, tiles, b, tq, tid, k_s, bias_s, bar_full, bar_empty, rank);
    if (kCluster > 1) cluster_sync();  // neither CTA leaves while its peer may still reach its shared memory
    return;
  }
  const ConsumerCtx ctx{p, n, b, tq, bt, split, head_block, tid, tiles.tile0, rank, bar_full, bar_empty,
                        smem_addr(q_s), smem_addr(k_s), smem_addr(smem + kSmemP), bias_s, alpha_s, flags_s, factor_s};
  if (wg == 1) {
    setmaxnreg_inc<Regs::kLead>();
    lead_consumer<kCluster, F0, F1>(ctx);
  } else {
    if constexpr (Regs::kPv < 168) setmaxnreg_dec<Regs::kPv>();
    pv_consumer<kCluster>(ctx);
  }
}

template <int kCluster, int F0, int F1>
int launch_t64(const SparseParams* p, cudaStream_t stream) {
  static bool configured = false;
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(v4_sparse_decode_t64_kernel<kCluster, F0, F1>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemT64Bytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((p->heads + kRows - 1) / kRows, p->batch * p->s_q, p->num_splits);
  cfg.blockDim = dim3(kT64Threads);
  cfg.dynamicSmemBytes = kSmemT64Bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return static_cast<int>(cudaLaunchKernelEx(&cfg, v4_sparse_decode_t64_kernel<kCluster, F0, F1>, *p));
}

}  // namespace

extern "C" {

// 64-record tiles. `cluster` != 0 pairs the two 64-head blocks of a token (65-128 heads) in a
// 2-CTA cluster (V4 records only). fmt0 / fmt1: the record formats of scope 0 / 1 (kFmt*; the
// same twice for one scope): both V4, or each a V4.1 window row or entry. Returns a cudaError_t
// (0 = success), or -1 for a cluster over other than two head blocks or a format pair not built.
int v4_sparse_decode_t64_sm90(const SparseParams* p, int cluster, int fmt0, int fmt1, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (fmt0 == kFmtV4 && fmt1 == kFmtV4) {
    if (!cluster) return launch_t64<1, kFmtV4, kFmtV4>(p, s);
    if ((p->heads + kRows - 1) / kRows != 2) return -1;
    return launch_t64<2, kFmtV4, kFmtV4>(p, s);
  }
  if (cluster) return -1;
  if (fmt0 == kFmtWindow && fmt1 == kFmtEntry) return launch_t64<1, kFmtWindow, kFmtEntry>(p, s);
  if (fmt0 == kFmtWindow && fmt1 == kFmtWindow) return launch_t64<1, kFmtWindow, kFmtWindow>(p, s);
  if (fmt0 == kFmtEntry && fmt1 == kFmtEntry) return launch_t64<1, kFmtEntry, kFmtEntry>(p, s);
  if (fmt0 == kFmtEntry && fmt1 == kFmtWindow) return launch_t64<1, kFmtEntry, kFmtWindow>(p, s);
  return -1;
}

int v4_sparse_decode_t64_sm90_smem_bytes() { return kSmemT64Bytes; }

}  // extern "C"
