// Parameters of the split-K decode kernels (flash_decode.metal), shared by
// host and kernel.  Host mirror: torch_metal_flash/planner/decode.py
// (DecodeParams, ctypes); an echo kernel checks the layout.  64-bit fields
// first, so that no implicit padding appears; the kernels copy it to
// threadgroup memory as whole 8-byte words.
#pragma once

struct DecodeParams {
  // q and out viewed as (B, Hq, Lq, D) and (B, Hq, Lq, Dv)
  long q_stride_b, q_stride_h, q_stride_l;
  // caches: (B_cache | num_blocks, L_max | page_size, Hkv, D | Dv)
  long k_stride_b, k_stride_l, k_stride_h;
  long v_stride_b, v_stride_l, v_stride_h;
  long o_stride_b, o_stride_h, o_stride_l;
  long bt_stride_b;            // block_table row stride
  long a_stride_b, a_stride_h;  // alibi slopes (B, Hq)
  long m_stride_b, m_stride_h, m_stride_q, m_stride_k;  // mask (B, Hq, Lq, Lk)
  int batch, heads, kv_heads, gqa;
  int seqlen_q, head_dim, page_size, num_splits;
  int diag_adjust, window_left, window_right, rows_per_tg;
  int row_blocks, num_threads;  // threads per threadgroup of flash_decode (>= 32 * ceil(rows_per_tg / 8))
  // kvcache_index.h: cache_seqlens when buffer 6 is not bound, rows appended
  // before this call, L_max or max_blocks * page_size, the caches' first dim
  int seqlen_fixed, seqlen_new, capacity, cache_rows;
  int mask_kind;                // flash::MaskKind of buffer 13
  int kv_bits, kv_group_size;   // quantized caches (kv_quant.h)
  int head_dim_v;               // v's and out's (head_dim is q's and k's)
  // q is multiplied by qk_scale when loaded: scale without softcap, scale /
  // softcap with softcap (then the score is softcap * tanh(q.k)).
  float qk_scale, softcap;
};
