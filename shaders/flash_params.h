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
  // alibi slopes (B, Hq) float32 (B: the sequences of a varlen problem)
  long a_stride_b, a_stride_h;
  // block_table (num_seqs, max_blocks) int32, its row stride (paged K/V)
  long bt_stride_b;

  int batch, heads, kv_heads, gqa;  // gqa = heads / kv_heads
  int seqlen_q, seqlen_k, head_dim, head_dim_v;
  // visible iff (window_left < 0 || j >= i + diag_offset - window_left)
  //         and (window_right < 0 || j <= i + diag_offset + window_right)
  int diag_offset, window_left, window_right, num_q_blocks;
  // Query heads packed into one threadgroup's rows (1, or gqa when the
  // query rows of one head do not fill a threadgroup): packed row r of head
  // group g is query row r % seqlen_q of head g * pack + r / seqlen_q, so the
  // K/V tiles are read once for all of them.
  int pack;
  // Sequences (grid z): the batch, or the sequences of cu_seqlens (varlen),
  // whose lengths are at most max_seqlen_q / max_seqlen_k (the grid covers
  // them; the probs output is (num_seqs, Hq, max_seqlen_q, max_seqlen_k)).
  int num_seqs, max_seqlen_q, max_seqlen_k;
  // Paged K/V (block_table): k/v are (num_blocks, Hkv, page_size, D)-indexed,
  // key p of sequence b is row p % page_size of block block_table[b, p / page_size].
  int page_size, num_blocks, max_blocks;
  // Dropout: an element is dropped when its Philox word is below the threshold
  // (p * 2^32); kept ones are scaled by dropout_scale (1 / (1 - p), 0 for p = 1).
  uint dropout_threshold;

  // q is multiplied by qk_scale when loaded: scale without softcap, scale /
  // softcap with softcap (then the score is softcap * tanh(q.k)).
  float qk_scale;
  float softcap;
  float dropout_scale;
  int pad_i;
};
