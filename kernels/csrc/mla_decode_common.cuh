// What the paged MLA decode kernels in this directory share: the launch parameters (mirrored by
// ``_Params`` in kernels/mla_decode_cuda.py: same order and types), a CTA's share of the split-KV
// tiles, and the cp.async helpers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

struct Params {
  const uint8_t* q;
  long long q_sb, q_ss, q_sh;  // strides in bytes of q [B, s_q, H, 576] (e4m3 or bf16)
  const uint8_t* kv;
  long long kv_sp, kv_st;      // page and token strides of kv [pages, page_size, 576], in bytes
  const int* block_tables;
  long long bt_s;
  const int* seq_lens;
  __nv_bfloat16* out;          // [B, s_q, H, 512] when num_splits == 1
  long long o_sb, o_ss, o_sh;
  float* lse;                  // [B, s_q, H] when num_splits == 1
  long long l_sb, l_ss, l_sh;
  __nv_bfloat16* part_o;       // [B * rows, num_splits, 512] when num_splits > 1: normalized, unscaled
  float* part_l;               // [B * rows, num_splits]
  int batch, s_q, heads, num_splits, page_size;
  float scale_log2;            // softmax_scale * q_scale * k_scale * log2(e)
  float out_scale;             // k_scale (V is the latent as stored)
};

namespace {

// Tiles [begin, end) of `tile`-token tiles that split `split` of a request of `seq_len` tokens
// takes (contiguous ranges; a split past the sequence gets none).
struct TileRange {
  int begin, end;
  __device__ TileRange(int seq_len, int tile, int num_splits, int split) {
    const int n_tiles = (seq_len + tile - 1) / tile;
    const int per_split = (n_tiles + num_splits - 1) / num_splits;
    begin = split * per_split;
    end = max(begin, min(n_tiles, begin + per_split));
  }
};

// Lets the grid launched after this one with programmatic dependent launch (the split combine,
// mla_decode_combine_sm90a.cu) schedule its CTAs now; they wait in griddepcontrol.wait until
// this grid has finished, so only the launch latency moves under this kernel.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes = 0 zero-fills (slots past a sequence never reach
// the MMAs, even when they hold NaN).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// The same for 8 bytes (through L1: cp.async.cg takes only 16).
__device__ __forceinline__ void cp_async_8(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

}  // namespace
