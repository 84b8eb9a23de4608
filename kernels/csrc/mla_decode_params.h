// The launch parameters shared by the paged MLA decode kernels in this directory
// (mirrored by ``_Params`` in kernels/mla_decode_cuda.py: same order and types).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

struct Params {
  const uint8_t* q;
  long long q_sb, q_ss, q_sh;  // strides in bytes (= elements) of q [B, s_q, H, 576]
  const uint8_t* kv;
  long long kv_sp, kv_st;      // page and token strides of kv [pages, page_size, 576]
  const int* block_tables;
  long long bt_s;
  const int* seq_lens;
  __nv_bfloat16* out;          // [B, s_q, H, 512] when num_splits == 1
  long long o_sb, o_ss, o_sh;
  float* lse;                  // [B, s_q, H] when num_splits == 1
  long long l_sb, l_ss, l_sh;
  float* part_o;               // [B * rows, num_splits, 512] when num_splits > 1
  float* part_l;               // [B * rows, num_splits]
  int batch, s_q, heads, num_splits, page_size;
  float scale_log2;            // softmax_scale * q_scale * k_scale * log2(e)
  float out_scale;             // k_scale (V is the FP8 latent)
};
