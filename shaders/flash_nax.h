// 16x16 fragments of the GPU's neural accelerators (Metal 4 tensor ops,
// MetalPerformancePrimitives' matmul2d on one simdgroup): the lane layout,
// operand loads from threadgroup tiles, the 16x32x16 multiply-accumulate and
// the online-softmax step over a simdgroup's 16 rows.  MSL 4.0.
//
// Lane layout of a 16x16 fragment (the one MLX reads and writes cooperative
// tensors by; the emulator implements it, docs/emulator.md): lane l owns 8
// elements, e = 4 * h + c (h, c in 0..1, 0..3) at
//   row = (qid & 4) + (l / 2) % 4 + 8 * h,  col = ((qid & 2) + l % 2) * 4 + c,  qid = l / 4,
// so each lane holds two rows (8 apart), four adjacent columns of each.  The
// lanes that share a row differ in bits 0 and 3 of the lane id, as in the 8x8
// simdgroup-matrix layout (flash::row_max / row_sum reduce over them).  An
// operand of several fragments (e.g. 16x32) holds them in row-major fragment
// order, 8 elements each.
#pragma once

#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#include "flash_frag.h"
#include "flash_softmax.h"

using namespace metal;

namespace flash {
namespace nax {

// The first row (the other is row + 8) and the first of the four columns a lane owns.
struct Coord {
  short row;
  short col;
};

// The 8x8 layout's row, and its first column doubled (four columns a lane, not two).
inline Coord coord(ushort lane) {
  const FragCoord f = frag_coord(lane);
  Coord c;
  c.row = f.row;
  c.col = short(2 * f.col);
  return c;
}

// One lane's 8 elements of a 16x16 fragment, e = 4 * h + c as above.
template <typename T>
struct Frag {
  T e[8];
};

// D0|D1 (16 x 32, float) += A (16 x 16) B (16 x 32; with TRANSPOSE_B, B^T is
// given: 32 x 16): one matmul2d on the simdgroup.  b holds B's two fragments
// as loaded by load_b / load_bt.  Relaxed precision as MLX runs it (the
// accelerators may round float operands; docs/emulator.md lists the blind spot).
template <bool TRANSPOSE_B, typename TA, typename TB>
__attribute__((always_inline)) inline
void mma(thread Frag<float>& d0, thread Frag<float>& d1, const thread Frag<TA>& a, const thread Frag<TB>* b) {
  constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(
      16, 32, 16, false, TRANSPOSE_B, true, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);
  mpp::tensor_ops::matmul2d<desc, metal::execution_simdgroup> op;
  auto ca = op.template get_left_input_cooperative_tensor<TA, TB, float>();
  auto cb = op.template get_right_input_cooperative_tensor<TA, TB, float>();
  auto cd = op.template get_destination_cooperative_tensor<metal::remove_addrspace_t<decltype(ca)>,
                                                           metal::remove_addrspace_t<decltype(cb)>, float>();
  for (short i = 0; i < 8; ++i) {
    ca[i] = a.e[i];
    cb[i] = b[0].e[i];
    cb[8 + i] = b[1].e[i];
    cd[i] = d0.e[i];
    cd[8 + i] = d1.e[i];
  }
  op.run(ca, cb, cd);
  for (short i = 0; i < 8; ++i) {
    d0.e[i] = cd[i];
    d1.e[i] = cd[8 + i];
  }
}

// B (16 x 32) from a row-major threadgroup tile whose top-left is src: its two
// fragments are columns 0..15 and 16..31 (P V: 16 keys x 32 head-dim columns).
template <typename T, int LD>
inline void load_b(thread Frag<T>* b, const threadgroup T* src, Coord c) {
  for (short f = 0; f < 2; ++f) {
    for (short h = 0; h < 2; ++h) {
      const threadgroup T* p = src + (c.row + 8 * h) * LD + f * 16 + c.col;
      for (short j = 0; j < 4; ++j) b[f].e[4 * h + j] = p[j];
    }
  }
}

// B^T (32 x 16) from a row-major threadgroup tile: its two fragments are rows
// 0..15 and 16..31 (Q K^T: 32 keys x 16 head-dim columns of the K tile).
template <typename T, int LD>
inline void load_bt(thread Frag<T>* b, const threadgroup T* src, Coord c) {
  for (short f = 0; f < 2; ++f) {
    for (short h = 0; h < 2; ++h) {
      const threadgroup T* p = src + (f * 16 + c.row + 8 * h) * LD + c.col;
      for (short j = 0; j < 4; ++j) b[f].e[4 * h + j] = p[j];
    }
  }
}

// A 16 x (16 NF) operand from device rows (row stride ld, contiguous columns)
// into a lane's fragments: zero at rows >= rows_valid and columns >= cols_valid.
template <typename T, int NF>
inline void load_device(thread Frag<T>* f, const device T* src, long ld, int rows_valid, int cols_valid, Coord c) {
  for (short h = 0; h < 2; ++h) {
    const int r = c.row + 8 * h;
    const device T* row = src + long(r) * ld;
    for (int dd = 0; dd < NF; ++dd) {
      for (short j = 0; j < 4; ++j) {
        const int d = dd * 16 + c.col + j;
        f[dd].e[4 * h + j] = r < rows_valid && d < cols_valid ? row[d] : T(0);
      }
    }
  }
}

// Float fragments of a 16 x (16 NF) block to device rows in T, rows < rows_valid and
// columns < cols_valid only.
template <typename T, int NF>
inline void store_device(const thread Frag<float>* f, device T* dst, long ld, int rows_valid, int cols_valid,
                         Coord c) {
  for (short h = 0; h < 2; ++h) {
    const int r = c.row + 8 * h;
    if (r >= rows_valid) continue;
    device T* row = dst + long(r) * ld;
    for (int dd = 0; dd < NF; ++dd) {
      for (short j = 0; j < 4; ++j) {
        const int d = dd * 16 + c.col + j;
        if (d < cols_valid) row[d] = T(f[dd].e[4 * h + j]);
      }
    }
  }
}

inline void zero(thread Frag<float>& f) {
  for (short i = 0; i < 8; ++i) f.e[i] = 0.0f;
}

// a += b, element-wise.
inline void add(thread Frag<float>& a, const thread Frag<float>& b) {
  for (short i = 0; i < 8; ++i) a.e[i] += b.e[i];
}

// B^T (32 keys x 16 columns, TRANSPOSED: Q K^T) or B (16 keys x 32 columns: P V)
// straight from device memory: key rows through `rows.row(key)` (contiguous or
// paged), zero at keys >= keys_end and columns >= cols_valid.  No threadgroup
// memory and no barrier: each simdgroup reads its own operands.
template <bool TRANSPOSED, typename T, typename Rows>
inline void load_rows(thread Frag<T>* b, Rows rows, int key0, int col0, int keys_end, int cols_valid, Coord c) {
  for (short f = 0; f < 2; ++f) {
    for (short h = 0; h < 2; ++h) {
      const int key = key0 + (TRANSPOSED ? f * 16 : 0) + c.row + 8 * h;
      const int col = col0 + (TRANSPOSED ? 0 : f * 16) + c.col;
      const bool live = key < keys_end;
      const device T* p = rows.row(live ? key : 0);  // key 0: an address that exists, never read
      for (short j = 0; j < 4; ++j) b[f].e[4 * h + j] = live && col + j < cols_valid ? p[col + j] : T(0);
    }
  }
}

// One key block of the online softmax for a lane's two rows (running max m[h],
// sum l[h]; -FLT_MAX while a row has seen nothing): S[kk] (16 rows x 16 keys)
// becomes P = exp(S - m_new), 0 where bit 8 * kk + e of `hidden` is set; l and
// the NF output fragments are rescaled by exp(m - m_new).  flash::softmax_step
// over this layout.
template <int NK, int NF>
__attribute__((always_inline)) inline
void softmax_step(thread Frag<float>* S, uint hidden, thread float* m, thread float* l, thread Frag<float>* O) {
  for (short h = 0; h < 2; ++h) {
    float mx = -FLT_MAX;
    for (int kk = 0; kk < NK; ++kk) {
      for (short j = 0; j < 4; ++j) mx = max(mx, S[kk].e[4 * h + j]);
    }
    mx = row_max(mx);
    const float m_new = max(m[h], mx);
    const float factor = exp_shifted(m[h] - m_new);
    float rs = 0.0f;
    for (int kk = 0; kk < NK; ++kk) {
      for (short j = 0; j < 4; ++j) {
        const short e = 4 * h + j;
        const float pr = (hidden >> (8 * kk + e)) & 1u ? 0.0f : exp_shifted(S[kk].e[e] - m_new);
        rs += pr;
        S[kk].e[e] = pr;
      }
    }
    rs = row_sum(rs);
    l[h] = l[h] * factor + rs;
    m[h] = m_new;
    for (int dd = 0; dd < NF; ++dd) {
      for (short j = 0; j < 4; ++j) O[dd].e[4 * h + j] *= factor;
    }
  }
}

}  // namespace nax
}  // namespace flash
