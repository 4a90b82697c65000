// Parameters of the KV-cache append kernel (kvcache_append.metal), shared by
// host and kernel.  Host mirror: torch_metal_flash/planner/kvcache.py
// (AppendParams, ctypes); an echo kernel checks the layout.  64-bit fields
// first; the kernel copies it to threadgroup memory as whole 8-byte words.
#pragma once

struct AppendParams {
  long k_stride_b, k_stride_l, k_stride_h;     // new k, v: (B, Lnew, Hkv, D | Dv)
  long v_stride_b, v_stride_l, v_stride_h;
  long kc_stride_b, kc_stride_l, kc_stride_h;  // caches: (B_cache | num_blocks, L_max | page_size, Hkv, D | Dv)
  long vc_stride_b, vc_stride_l, vc_stride_h;
  long q_stride_b, q_stride_l, q_stride_h;     // q: (B, Lq, Hq, D)
  long qr_stride_b, qr_stride_l, qr_stride_h;  // rotated q
  long bt_stride_b;                            // block_table row stride
  long cos_stride, sin_stride;                 // rotary table row strides
  int batch, seqlen_new, seqlen_q, heads;
  int kv_heads, head_dim, rotary_dim, seqlen_ro;
  int page_size, capacity, cache_rows, seqlen_fixed;  // seqlen_fixed: cache_seqlens when no tensor is given
  int kv_rows, q_local;                        // kv_rows = B * Lnew * Hkv
  int kv_bits, kv_group_size;                  // quantized caches
  int head_dim_v, pad_i;                       // v's head dim (head_dim: k's and q's)
};
