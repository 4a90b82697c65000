// Parameters of the FlashAttention kernels, shared by host and kernel.
//
// The host mirror is torch_metal_flash/planner/params.py (ctypes); a test
// compiles a kernel that writes sizeof/offsetof of every field and compares.
// Keep the 64-bit fields first so that no implicit padding appears.
//
// All strides are in elements of the tensor they describe.  Tensors are
// indexed with logical dims (B, H, L, D); the last dim is contiguous.
#pragma once

struct FlashFwdParams {
  // q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), o (B, Hq, Lq, Dv)
  long q_stride_b, q_stride_h, q_stride_l;
  long k_stride_b, k_stride_h, k_stride_l;
  long v_stride_b, v_stride_h, v_stride_l;
  long o_stride_b, o_stride_h, o_stride_l;
  // mask, a broadcast view (B, Hq, Lq, Lk): any strides, 0 for broadcast dims
  long m_stride_b, m_stride_h, m_stride_q, m_stride_k;
  // alibi slopes (B, Hq) float32
  long a_stride_b, a_stride_h;

  int batch, heads, kv_heads, gqa;  // gqa = heads / kv_heads
  int seqlen_q, seqlen_k, head_dim, head_dim_v;
  // visible iff (window_left < 0 || j >= i + diag_offset - window_left)
  //         and (window_right < 0 || j <= i + diag_offset + window_right)
  int diag_offset, window_left, window_right, num_q_blocks;
  // Query heads packed into one threadgroup's rows (1, or gqa when the
  // query rows of one head do not fill a threadgroup): packed row r of head
  // group g is query row r % seqlen_q of head g * pack + r / seqlen_q, so the
  // K/V tiles are read once for all of them.
  int pack, pad_i;

  // q is multiplied by qk_scale when loaded: scale without softcap, scale /
  // softcap with softcap (then the score is softcap * tanh(q.k)).
  float qk_scale;
  float softcap;
};
