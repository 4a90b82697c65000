// Parameters of the FlashAttention backward kernels, shared by host and kernel.
//
// The forward's FlashFwdParams (q/k/v strides, `o` = the saved forward output,
// mask, ALiBi, sizes, band, and qk_scale / softcap: the backward recomputes
// the scores exactly as the forward does) plus the strides of dO and of the
// gradients.  Host mirror: torch_metal_flash/planner/backward.py
// (ctypes, embedding planner/params.py's FlashFwdParams).  All strides in
// elements; the last dim of every tensor is contiguous.  64-bit fields first.
#pragma once

#include "flash_params.h"

struct FlashBwdParams {
  FlashFwdParams f;
  // dO (B, Hq, Lq, Dv), dq (B, Hq, Lq, D), dk (B, Hkv, Lk, D), dv (B, Hkv, Lk, Dv)
  long do_stride_b, do_stride_h, do_stride_l;
  long dq_stride_b, dq_stride_h, dq_stride_l;
  long dk_stride_b, dk_stride_h, dk_stride_l;
  long dv_stride_b, dv_stride_h, dv_stride_l;
  // dbias (B, Hq, Lq, Lk) float32, last dim contiguous
  long db_stride_b, db_stride_h, db_stride_q;
  int rows;          // B * Hq * Lq (rows of the delta / stats scratch vectors)
  int num_k_blocks;  // key blocks of the dK/dV kernel
  float scale;       // the softmax scale (dS of the final score -> d(q.k))
  int pad_i;
};
