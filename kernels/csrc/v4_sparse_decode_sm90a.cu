// DeepSeek-V4 sparse decode (FlashMLA's MODEL1 records: 448 e4m3 dims with a UE8M0 exponent per
// 64, then 64 bf16 RoPE dims), 64 query heads per CTA, Hopper (sm_90a) wgmma in fp16.
//
// Contract: kernels/v4_sparse_decode.py (lse without the sink, out scaled by 1/(1+e^(sink-lse)),
// no valid key -> out 0 and lse +inf); the Python side is kernels/v4_sparse_decode_cuda.py. Why
// this design (the budget and the cost model: benchmarks/KERNEL_NOTES.md):
//
// - A CTA = one query token x 64 heads x one split of the token's 32-record tiles (the window
//   scope's tiles, then the selected entries'). 128 heads take two CTAs side by side on the grid
//   (the second gather of a record is an L2 hit): all 128 heads x 512 fp32 output values would
//   be the SM's whole register file.
// - Warpgroup 0 is the producer (v4_sparse_decode_common.cuh): it gathers each tile's records by
//   index (cp.async, 16 bytes, or 8 for one-record row pools; four raw stages in flight) and
//   dequantizes each record once into fp16 in shared memory
//   (two stages): e4m3 pairs take one cvt to f16x2 and one packed multiply by the power-of-two
//   scale; the RoPE dims bf16 -> fp16. Each producer thread converts exactly the bytes it
//   copied, so a thread's own cp.async wait is all the synchronization the raw stages need.
// - Warpgroups 1 and 2 are the consumers, each owning half of the 512 output dims (128 fp32
//   accumulators per thread). S = Q.K^T is split the same way: each consumer computes the
//   partial scores over its 256 dims (m64n32k16, both operands in shared memory), the two
//   exchange partials through shared memory and both hold the full scores (a + b = b + a: the
//   same softmax bit for bit in both). P stays in registers as the A operand of O += P.V
//   (m64n256k16, V = the same fp16 tile read N-major). The next tile's scores are issued before
//   this tile's exchange and softmax.
// - Records the indices leave out (-1, past a scope's length, the tile's tail) are never
//   loaded (zero-filled copies) and their scores are -inf: poisoned cache pages never reach
//   the products. Split-KV writes normalized partials and the natural-log LSE; the combine
//   (kernels/v4_sparse_decode_triton.py) merges them and applies the sink. Launch shapes come
//   from tensor shapes only: capturable in a CUDA graph.

#include "v4_sparse_decode_common.cuh"

namespace {

constexpr int kHeads = 64;    // query rows per CTA (wgmma M)
constexpr int kThreads = 384;  // producer + two consumers
// Registers per thread after the hand-over: the producer keeps 56, each consumer gets 224
// ((56 + 2 x 224) x 128 = 64512 of the 65536).
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
constexpr int kQBox = kHeads * 128;          // 8192
constexpr int kQBytes = 8 * kQBox;           // 65536

constexpr int kSmemQ = 0;
constexpr int kSmemK = kSmemQ + kQBytes;
constexpr int kSmemRaw = kSmemK + kKStages * kKBytes;
constexpr int kSmemXchg = kSmemRaw + kRawStages * kRawBytes;
constexpr int kSmemBias = kSmemXchg + kXchgBytes;           // per K stage and record: 0 or -inf
constexpr int kSmemBars = kSmemBias + kKStages * kRec * 4;  // full[2], empty[2]
constexpr int kSmemBytes = kSmemBars + 2 * kKStages * 8 + 1024;
static_assert(kSmemBytes <= 227 * 1024, "shared memory plan exceeds the SM's 227 KB");

constexpr int kBarConsumersA = 1, kBarConsumersB = 2;  // named barriers of the two consumers

__global__ void __launch_bounds__(kThreads, 1) v4_sparse_decode_kernel(const __grid_constant__ SparseParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* q_s = smem + kSmemQ;
  uint8_t* k_s = smem + kSmemK;
  uint8_t* raw_s = smem + kSmemRaw;
  float* xchg = reinterpret_cast<float*>(smem + kSmemXchg);
  float* bias_s = reinterpret_cast<float*>(smem + kSmemBias);
  const uint32_t bar_full = smem_addr(smem + kSmemBars), bar_empty = bar_full + 8 * kKStages;

  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int head_block = blockIdx.x, bt = blockIdx.y, split = blockIdx.z;
  const int b = bt / p.s_q, tq = bt % p.s_q;
  const CtaTiles tiles(p, split);
  const int n = tiles.n;
  load_q_tile<kHeads>(p, b, tq, head_block * kHeads, q_s, tid, kThreads);
  if (tid == 0) {
    for (int s = 0; s < kKStages; ++s) {
      mbar_init_count(bar_full + 8 * s, 128);
      mbar_init_count(bar_empty + 8 * s, 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  fence_async_shared();
  __syncthreads();

  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    produce_tiles(p, tiles, b, tq, tid, raw_s, k_s, bias_s, bar_full, bar_empty);
    return;
  }

  // ---- consumers: warpgroup 1 + c owns output dims 256c..256c+255 ---------------------------
  setmaxnreg_inc<kConsumerRegs>();
  const int c = wg - 1, tw = tid & 127;
  const int warp = tw >> 5, lane = tid & 31, g = lane >> 2, q4 = lane & 3;
  const uint32_t q_base = smem_addr(q_s), k_base = smem_addr(k_s);
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float* xchg_own = xchg + c * (kXchgBytes / 8);
  const float* xchg_other = xchg + (1 - c) * (kXchgBytes / 8);

  // Partial S over this consumer's 256 dims of tile t: 16 k-steps of 16 dims (32 bytes of a box
  // row), issued asynchronously.
  auto issue_qk = [&](int t, float (&acc)[16]) {
    const uint32_t kt = k_base + (t % kKStages) * kKBytes;
    mbar_wait(bar_full + 8 * (t % kKStages), (t / kKStages) & 1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      const int gk = 16 * c + kk, box = gk >> 2, off = (gk & 3) * 32;
      const uint64_t dq = make_desc(desc_lo(q_base + box * kQBox + off, 16), 1024, kSwizzle128);
      const uint64_t dk = make_desc(desc_lo(kt + box * kKBox + off, 16), 1024, kSwizzle128);
      wgmma_m64n32k16_f16(acc, dq, dk, kk);
    }
    wgmma_commit();
  };
  // Tile t + 1's scores run on the tensor cores under tile t's exchange and softmax; both
  // groups (those scores, tile t's P.V) land before the loop's back edge: anything in flight
  // across it, or wgmma groups that differ between paths, make ptxas serialize every wgmma
  // (the last tile issues its own scores again, unused, for the same reason).
  // O is rescaled lazily: a row's reference maximum moves only when a score passes it by
  // kRescaleSlack (log2 units; P <= 2^8 then, well inside fp16), decided for both consumers at
  // once. (O may change while the next scores are in flight: they do not touch it. A wait inside
  // the rare branch instead makes ptxas serialize the pipeline.)
  float s_next[16];
  if (n > 0) {
    issue_qk(0, s_next);
    wgmma_wait<0>();
    fence_regs(s_next);
  }
  for (int t = 0; t < n; ++t) {
    const int ks = t % kKStages;
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = s_next[i];
    issue_qk(min(t + 1, n - 1), s_next);
    // Exchange the partials (the same thread of the other consumer holds the same positions).
#pragma unroll
    for (int v = 0; v < 4; ++v)
      *reinterpret_cast<float4*>(xchg_own + (v * 128 + tw) * 4) = make_float4(s[4 * v], s[4 * v + 1], s[4 * v + 2], s[4 * v + 3]);
    named_barrier_sync(kBarConsumersA, 256);
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const float4 x = *reinterpret_cast<const float4*>(xchg_other + (v * 128 + tw) * 4);
      s[4 * v] += x.x;
      s[4 * v + 1] += x.y;
      s[4 * v + 2] += x.z;
      s[4 * v + 3] += x.w;
    }
    // Scores in log2 units; rows 16 warp + g + 8i, records 8j + 2q4 + e at s[4j + 2i + e].
    float mx[2];
    scale_and_row_max<4>(s, bias_s + ks * kRec, p.scale_log2, q4, mx);
    const bool move[2] = {mx[0] > m_run[0] + kRescaleSlack, mx[1] > m_run[1] + kRescaleSlack};
    // Both consumers have read the partials (the buffers may be written again) and agree on
    // whether any row moves (they hold the same scores).
    if (named_barrier_any(kBarConsumersB, 256, move[0] || move[1])) {
      float alpha[2];
      move_reference(move, mx, m_run, l_run, alpha);
      scale_rows(o, alpha[0], alpha[1]);
    }
    uint32_t a[2][4];
    exp_sum_pack<4>(s, m_run, l_run, a);
    // O[64 x this consumer's 256 dims] += P . V: V rows of 16 records, 4 boxes of 64 dims.
    const uint32_t kt = k_base + ks * kKBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const uint64_t dv = make_desc(desc_lo(kt + 4 * c * kKBox + kk * 16 * 128, p.v_desc_lead), p.v_desc_stride,
                                    kSwizzle128);
      wgmma_m64n256k16_f16_rs_tnspb(o, a[kk], dv, 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s_next);
    fence_regs(o);
    mbar_arrive(bar_empty + 8 * ks);  // this consumer is done with the stage
  }

  // ---- epilogue -------------------------------------------------------------------------------
  const bool split_kv = p.num_splits > 1;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = l_run[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int head = head_block * kHeads + 16 * warp + g + 8 * i;
    const bool lonely = !(l > 0.f);
    const float lse = lonely ? -INFINITY : (m_run[i] + log2f(l)) * kLn2;
    float factor = lonely ? 0.f : 1.f / l;
    if (!split_kv && p.sinks != nullptr && !lonely && head < p.heads) factor /= 1.f + expf(p.sinks[head] - lse);
    if (head >= p.heads) continue;
    store_row(p, o, i, factor, head, c, q4, b, tq, bt, split);
    if (c == 0 && q4 == 0) store_lse(p, head, lse, b, tq, bt, split);
  }
}

}  // namespace

extern "C" {

// Returns a cudaError_t (0 = success).
int v4_sparse_decode_sm90(const SparseParams* p, void* stream) {
  static bool configured = false;
  if (!configured) {
    const cudaError_t err =
        cudaFuncSetAttribute(v4_sparse_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  const dim3 grid((p->heads + kHeads - 1) / kHeads, p->batch * p->s_q, p->num_splits);
  v4_sparse_decode_kernel<<<grid, kThreads, kSmemBytes, static_cast<cudaStream_t>(stream)>>>(*p);
  return static_cast<int>(cudaGetLastError());
}

int v4_sparse_decode_sm90_smem_bytes() { return kSmemBytes; }

// The size of SparseParams as this library was built, checked against the ctypes mirror at load.
int v4_sparse_decode_sm90_params_bytes() { return static_cast<int>(sizeof(SparseParams)); }

}  // extern "C"
