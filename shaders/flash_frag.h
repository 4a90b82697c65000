// 8x8 simdgroup-matrix fragments: the lane layout, row reductions over it,
// fragment loads and stores (threadgroup and device memory) and the Q K^T
// block product.  Plain MSL; every pointer carries its address space.
#pragma once

#include <metal_stdlib>

using namespace metal;

namespace flash {

// ---------------------------------------------------------------------------
// Fragment lane layout (Apple does not document it; MLX relies on the same
// mapping, and the emulator implements it, docs/emulator.md).  Lane l owns the elements
// (row, col) and (row, col + 1) of every 8x8 simdgroup matrix, where
//   qid = l / 4; row = (qid & 4) + (l / 2) % 4; col = (qid & 2) * 2 + (l % 2) * 2.
// The lanes that share a row differ in bits 0 and 3 of the lane id.
// ---------------------------------------------------------------------------
struct FragCoord {
  short row;
  short col;
};

inline FragCoord frag_coord(ushort lane) {
  const short qid = short(lane / 4);
  FragCoord c;
  c.row = short((qid & 4) + (lane / 2) % 4);
  c.col = short((qid & 2) * 2 + (lane % 2) * 2);
  return c;
}

// Reductions over the 4 lanes that share a fragment row.
inline float row_max(float x) {
  x = max(x, simd_shuffle_xor(x, ushort(1)));
  x = max(x, simd_shuffle_xor(x, ushort(8)));
  return x;
}

inline float row_sum(float x) {
  x += simd_shuffle_xor(x, ushort(1));
  x += simd_shuffle_xor(x, ushort(8));
  return x;
}

// Load an 8x8 float fragment from a row-major threadgroup tile of T whose
// top-left element is src (leading dimension ld): m[r][c] = src[r * ld + c].
template <typename T>
inline void load_frag(thread simdgroup_float8x8& m, const threadgroup T* src, int ld,
                      FragCoord fc) {
  const threadgroup T* p = src + fc.row * ld + fc.col;
  m.thread_elements()[0] = float(p[0]);
  m.thread_elements()[1] = float(p[1]);
}

// Transposed: m[r][c] = src[c * ld + r].
template <typename T>
inline void load_frag_t(thread simdgroup_float8x8& m, const threadgroup T* src, int ld,
                        FragCoord fc) {
  const threadgroup T* p = src + fc.col * ld + fc.row;
  m.thread_elements()[0] = float(p[0]);
  m.thread_elements()[1] = float(p[ld]);
}

// Load an 8x8 fragment straight from device memory (rows of stride ld),
// rows >= rows_valid and cols >= cols_valid read as zero, scaled by `scale`.
template <typename T>
inline void load_frag_device(thread simdgroup_float8x8& m, const device T* src, long ld,
                             int rows_valid, int cols_valid, FragCoord fc, float scale) {
  float e0 = 0.0f, e1 = 0.0f;
  if (fc.row < rows_valid) {
    const device T* p = src + long(fc.row) * ld + fc.col;
    if (fc.col < cols_valid) e0 = float(p[0]) * scale;
    if (fc.col + 1 < cols_valid) e1 = float(p[1]) * scale;
  }
  m.thread_elements()[0] = e0;
  m.thread_elements()[1] = e1;
}

// Per-lane-row variants: each lane passes the start of its own fragment row
// (rows need not be equally spaced, e.g. packed GQA heads).
template <typename T>
inline void load_frag_rows(thread simdgroup_float8x8& m, const device T* row, bool row_valid,
                           int cols_valid, FragCoord fc, float scale) {
  float e0 = 0.0f, e1 = 0.0f;
  if (row_valid) {
    if (fc.col < cols_valid) e0 = float(row[fc.col]) * scale;
    if (fc.col + 1 < cols_valid) e1 = float(row[fc.col + 1]) * scale;
  }
  m.thread_elements()[0] = e0;
  m.thread_elements()[1] = e1;
}

template <typename T>
inline void store_frag_rows(thread simdgroup_float8x8& m, device T* row, bool row_valid,
                            int cols_valid, FragCoord fc, float scale) {
  if (row_valid) {
    if (fc.col < cols_valid) row[fc.col] = T(m.thread_elements()[0] * scale);
    if (fc.col + 1 < cols_valid) row[fc.col + 1] = T(m.thread_elements()[1] * scale);
  }
}

// Store an 8x8 fragment to device memory as T, guarded like load_frag_device.
template <typename T>
inline void store_frag_device(thread simdgroup_float8x8& m, device T* dst, long ld,
                              int rows_valid, int cols_valid, FragCoord fc, float scale) {
  if (fc.row < rows_valid) {
    device T* p = dst + long(fc.row) * ld + fc.col;
    if (fc.col < cols_valid) p[0] = T(m.thread_elements()[0] * scale);
    if (fc.col + 1 < cols_valid) p[1] = T(m.thread_elements()[1] * scale);
  }
}

inline void frag_scale(thread simdgroup_float8x8& m, float s) {
  m.thread_elements()[0] *= s;
  m.thread_elements()[1] *= s;
}

// a += b, element-wise (every lane its two elements).
__attribute__((always_inline)) inline
void frag_add(thread simdgroup_float8x8& a, simdgroup_float8x8 b) {
  a.thread_elements()[0] += b.thread_elements()[0];
  a.thread_elements()[1] += b.thread_elements()[1];
}

// Above head dim 256 the scores are summed as ScoreSlices chains, one per
// equal slice of the head dim, added in slice order: the head-dim-split
// kernels give each simdgroup one slice, and every other kernel of the bucket
// adds the same chains in the same order, so all of them see the same scores.
template <int BD>
struct ScoreSlices {
  static constant constexpr int value = BD > 256 ? 4 : 1;
};

// One score fragment: Q K^T over NF fragments of the head dim, 8 query rows
// (Qf) x the 8 keys of the threadgroup tile rows Kr (row stride LD), one
// multiply-accumulate chain, in order.
template <int NF, int LD, typename T>
__attribute__((always_inline)) inline
simdgroup_float8x8 qk_frag(const thread simdgroup_float8x8* Qf, const threadgroup T* Kr, FragCoord fc) {
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (int dd = 0; dd < NF; ++dd) {
    simdgroup_float8x8 Kt;
    load_frag_t(Kt, Kr + dd * 8, LD, fc);
    simdgroup_multiply_accumulate(acc, Qf[dd], Kt, acc);
  }
  return acc;
}

// S[kk] = Q K^T over NF fragments for the keys kk * 8.. of the tile Ks: one
// chain per fragment (a head-dim split's share of the scores).
template <int NF, int NK, int LD, typename T>
__attribute__((always_inline)) inline
void qk_chain(thread simdgroup_float8x8* S, const thread simdgroup_float8x8* Qf, const threadgroup T* Ks,
              FragCoord fc) {
  for (int kk = 0; kk < NK; ++kk) S[kk] = qk_frag<NF, LD>(Qf, Ks + kk * 8 * LD, fc);
}

// S[kk] = Q K^T over the whole head dim (NF fragments): the chains of its
// ScoreSlices slices, added in order.  Every kernel that needs the scores
// (forward, dQ, decode) computes them here or slice by slice (qk_chain,
// slice_put / slice_gather), so the backward sees the forward's scores bit for bit.
template <int NF, int NK, int LD, typename T>
__attribute__((always_inline)) inline
void qk_block(thread simdgroup_float8x8* S, const thread simdgroup_float8x8* Qf, const threadgroup T* Ks,
              FragCoord fc) {
  constexpr int SL = ScoreSlices<NF * 8>::value;
  constexpr int NFS = NF / SL;
  static_assert(NF % SL == 0, "equal slices");
  for (int kk = 0; kk < NK; ++kk) {
    S[kk] = qk_frag<NFS, LD>(Qf, Ks + kk * 8 * LD, fc);
    for (int s = 1; s < SL; ++s) frag_add(S[kk], qk_frag<NFS, LD>(Qf + s * NFS, Ks + kk * 8 * LD + s * NFS * 8, fc));
  }
}

// This simdgroup's share of S = Q K^T: the whole head dim's scores (DS = 1,
// qk_block), or the chain of its slice (NF fragments from column slice * NF * 8),
// which slice_sum adds to the other slices'.
template <int DS, int NF, int NK, int LD, typename T>
__attribute__((always_inline)) inline
void qk_share(thread simdgroup_float8x8* S, const thread simdgroup_float8x8* Qf, const threadgroup T* Ks, int slice,
              FragCoord fc) {
  if (DS == 1) {
    qk_block<NF, NK, LD>(S, Qf, Ks, fc);
  } else {
    qk_chain<NF, NK, LD>(S, Qf, Ks + slice * NF * 8, fc);
  }
}

// Head-dim split: the simdgroups of a row group each hold the partial
// products of their slice; slice_put stores a simdgroup's N fragments into
// its row group's exchange area (DS * N fragments of 64 floats, slice-major),
// and after a threadgroup barrier slice_gather sums them in slice order, so
// every simdgroup of the group holds the same totals.
template <int N>
inline void slice_put(const thread simdgroup_float8x8* X, threadgroup float* area, int slice, FragCoord fc) {
  for (int n = 0; n < N; ++n) {
    threadgroup float* dst = area + (slice * N + n) * 64 + fc.row * 8 + fc.col;
    dst[0] = X[n].thread_elements()[0];
    dst[1] = X[n].thread_elements()[1];
  }
}

template <int DS, int N>
inline void slice_gather(thread simdgroup_float8x8* X, const threadgroup float* area, FragCoord fc) {
  for (int n = 0; n < N; ++n) {
    const threadgroup float* src = area + n * 64 + fc.row * 8 + fc.col;
    X[n].thread_elements()[0] = src[0];
    X[n].thread_elements()[1] = src[1];
    for (int s = 1; s < DS; ++s) {
      X[n].thread_elements()[0] += src[s * N * 64];
      X[n].thread_elements()[1] += src[s * N * 64 + 1];
    }
  }
}

// The row group's sums of its slices' partials X (and Y, when TWO: the area
// then holds 2 * DS * N fragments), in slice order.  Every simdgroup calls it,
// `active` (holding partials) or not: it contains a threadgroup barrier.  The
// caller's next write to the area must come after another barrier.
template <int DS, int N, bool TWO>
inline void slice_sum(thread simdgroup_float8x8* X, thread simdgroup_float8x8* Y, threadgroup float* area, int slice,
                      bool active, FragCoord fc) {
  if (active) {
    slice_put<N>(X, area, slice, fc);
    if (TWO) slice_put<N>(Y, area + DS * N * 64, slice, fc);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (active) {
    slice_gather<DS, N>(X, area, fc);
    if (TWO) slice_gather<DS, N>(Y, area + DS * N * 64, fc);
  }
}

}  // namespace flash
