// Reusable pieces of the FlashAttention kernels (forward and backward):
// 8x8 simdgroup-matrix fragments with the lane layout, cooperative tile
// loaders (device -> threadgroup, guarded and zero-padded), the band/mask
// logic and the score transforms.  Plain MSL; every pointer carries its
// address space.
#pragma once

#include <metal_stdlib>
#include "flash_params.h"

using namespace metal;

namespace flash {

constant constexpr float kLog2e = 1.4426950408889634f;
constant constexpr float kLn2 = 0.6931471805599453f;

// Element padding of threadgroup tile rows: 16 bytes per row against bank
// conflicts (4 floats, 8 halves/bfloats).
template <typename T>
struct TilePad {
  static constant constexpr int value = 16 / sizeof(T);
};

// Whether the backward's row state (aux, written by the forward) holds the
// float32 output row after (m, l): for inputs narrower than float, whose
// output is rounded (the backward's delta must not see that rounding).
template <typename T>
struct AuxHasOut {
  static constant constexpr bool value = true;
};
template <>
struct AuxHasOut<float> {
  static constant constexpr bool value = false;
};

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

// ---------------------------------------------------------------------------
// Cooperative tile loader: ROWS x COLS elements from device (row stride
// src_ld, contiguous columns) into a threadgroup tile (row stride dst_ld),
// by NT threads.  Rows >= rows_valid and columns >= cols_valid are written as
// zero and never read from device.  Every thread of the threadgroup must call
// it (it contains no barrier).
//
// vec_ok: src and src_ld are aligned to 4 elements and dst_ld, COLS are
// multiples of 4, so full tiles move as 4-element vectors.
// ---------------------------------------------------------------------------
template <typename T, int ROWS, int COLS, int NT>
inline void load_tile(threadgroup T* dst, int dst_ld, const device T* src, long src_ld,
                      int rows_valid, int cols_valid, bool cols_aligned, bool vec_ok, ushort tid) {
  constexpr int kTotal = ROWS * COLS;
  if (cols_aligned && rows_valid >= ROWS) {
    if (vec_ok) {
      static_assert(COLS % 4 == 0, "vector loads need COLS % 4 == 0");
      for (int idx = tid; idx < kTotal / 4; idx += NT) {
        const int r = (idx * 4) / COLS;
        const int c = idx * 4 - r * COLS;
        *(threadgroup vec<T, 4>*)(dst + r * dst_ld + c) =
            *(const device vec<T, 4>*)(src + long(r) * src_ld + c);
      }
    } else {
      for (int idx = tid; idx < kTotal; idx += NT) {
        const int r = idx / COLS;
        const int c = idx - r * COLS;
        dst[r * dst_ld + c] = src[long(r) * src_ld + c];
      }
    }
  } else {
    for (int idx = tid; idx < kTotal; idx += NT) {
      const int r = idx / COLS;
      const int c = idx - r * COLS;
      T x = T(0.0f);
      if (r < rows_valid && c < cols_valid) x = src[long(r) * src_ld + c];
      dst[r * dst_ld + c] = x;
    }
  }
}

// ---------------------------------------------------------------------------
// The band: visible iff (wl < 0 || j >= i + diag - wl) && (wr < 0 || j <= i + diag + wr).
// ---------------------------------------------------------------------------
struct Band {
  int diag;
  int wl;
  int wr;

  bool visible(int i, int j) const {
    const int rel = j - (i + diag);
    return (wl < 0 || rel >= -wl) && (wr < 0 || rel <= wr);
  }

  // Keys [lo, hi) that any query row in [i0, i1] (inclusive) can see,
  // clamped to [0, lk).  hi <= lo means none.
  void key_range(int i0, int i1, int lk, thread int& lo, thread int& hi) const {
    lo = 0;
    hi = lk;
    if (wl >= 0) lo = max(lo, i0 + diag - wl);
    if (wr >= 0) hi = min(hi, i1 + diag + wr + 1);
  }

  // True when every (i, j) with i in [i0, i1] and j in [j0, j1] is visible.
  bool block_inside(int i0, int i1, int j0, int j1) const {
    return (wl < 0 || j0 - (i1 + diag) >= -wl) && (wr < 0 || j1 - (i0 + diag) <= wr);
  }
};

// Query positions covered by packed rows [ra, rb] (inclusive), where packed
// row r is position r % lq of head r / lq: exact within one head, all
// positions when the span crosses a head boundary.
inline void packed_row_span(int ra, int rb, int lq, thread int& i0, thread int& i1) {
  if (ra / lq == rb / lq) {
    i0 = ra % lq;
    i1 = rb % lq;
  } else {
    i0 = 0;
    i1 = lq - 1;
  }
}

// Query rows [i0, i1] (inclusive) whose band intersects keys [j0, j1].
// Used by backward kernels iterating over query blocks for a key block.
inline void query_range(Band band, int j0, int j1, int lq, thread int& lo, thread int& hi) {
  lo = 0;
  hi = lq;
  // j <= i + diag + wr  <=>  i >= j - diag - wr (for the smallest j)
  if (band.wr >= 0) lo = max(lo, j0 - band.diag - band.wr);
  // j >= i + diag - wl  <=>  i <= j - diag + wl (for the largest j)
  if (band.wl >= 0) hi = min(hi, j1 - band.diag + band.wl + 1);
}

// tanh(x) that stays accurate and finite for every x under fast math: an odd
// Taylor polynomial for |x| < 0.25 (relative error < 2e-8; the exp2 form
// loses relative precision there through the cancellation in 1 - t), else
// (1 - t) / (1 + t) with t = exp2(-2 |x| log2e), which never overflows.
inline float tanh_stable(float x) {
  const float ax = abs(x);
  if (ax < 0.25f) {
    const float x2 = x * x;
    return x * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f + x2 * (-17.0f / 315.0f +
                                                                        x2 * (62.0f / 2835.0f)))));
  }
  const float t = exp2(-2.0f * kLog2e * ax);
  return copysign((1.0f - t) / (1.0f + t), x);
}

// The softcapped score: cap * tanh(x), x = scale * q.k / cap.
inline float softcap_tanh(float x, float cap) {
  return tanh_stable(x) * cap;
}

// Mask element kinds (function constant mask_kind).
enum MaskKind : int {
  kMaskNone = 0,
  kMaskBool = 1,  // 1 byte, nonzero = visible
  kMaskF32 = 2,
  kMaskF16 = 3,
  kMaskBF16 = 4,
};

// exp(d) of a shifted score d = s - m <= 0: 0 below -1000 (the floor also keeps
// d * log2e finite for d near -FLT_MAX).  The floor is a compare-select, not max():
// max() returns the other operand of a NaN, and a NaN score must make its row NaN,
// as in torch's SDPA (in the relaxed and safe math modes; fast math assumes no NaN).
inline float exp_shifted(float d) {
  return exp2((d < -1000.0f ? -1000.0f : d) * kLog2e);
}

// Whether a row (or split) with softmax sum l saw a key.  l >= 0 for numbers; a
// NaN score makes l NaN, and that row must come out NaN, as in torch's SDPA (in the
// relaxed and safe math modes): so l != 0, never l > 0.  The epilogues of the
// forward and decode kernels and the split combine all decide through this.
inline bool saw_keys(float l) { return l != 0.0f; }

// The epilogue's 1 / l: O / l of a row, 0 for a row that saw nothing (its O is 0).
inline float inv_row_sum(float l) { return saw_keys(l) ? 1.0f / l : 0.0f; }

// lse = m + ln(l) of a row, or +inf when it saw nothing; NaN when l is.  The
// infinity is stored as bits through an integer select: under fast math a
// floating-point select that yields inf may be assumed not to.
inline void store_lse(device float* dst, float m, float l) {
  const uint bits = saw_keys(l) ? as_type<uint>(m + log2(l) * kLn2) : 0x7f800000u;
  *reinterpret_cast<device uint*>(dst) = bits;
}

// Read the additive float mask element at `off` (elements) of kind `kind`.
// A -inf entry sets `neg_inf` and reads as 0: it is tested on the bits of the
// stored type, so no infinity enters the arithmetic (fast math assumes none).
inline float read_float_mask(const device uchar* base, long off, int kind, thread bool& neg_inf) {
  if (kind == kMaskF32) {
    const float x = ((const device float*)base)[off];
    neg_inf = as_type<uint>(x) == 0xff800000u;
    return neg_inf ? 0.0f : x;
  }
  const ushort bits = ((const device ushort*)base)[off];
  neg_inf = bits == (kind == kMaskF16 ? 0xfc00u : 0xff80u);
  if (neg_inf) return 0.0f;
  return kind == kMaskF16 ? float(as_type<half>(bits)) : float(as_type<bfloat>(bits));
}


// ---------------------------------------------------------------------------
// One batch entry's rows and keys.  A padded problem's are the params'; a
// varlen problem's (cu_seqlens) sequence b owns rows [q0, q0 + lq) of the one
// packed batch of q/o/lse/aux and keys [k0, k0 + lk) of k/v (or, paged, keys
// 0..lk-1 through its block-table row), its band aligned to its own
// bottom-right corner (diag_offset counts from there).  Values out of range
// are clamped to the tensors, never used to address memory outside them.
// ---------------------------------------------------------------------------
struct Seq {
  int bt;       // batch index into the tensors (b; 0 for varlen: one packed batch)
  int q0;       // first row in q / o / lse / aux
  int lq;       // query rows
  int k0;       // first key row in k / v (contiguous K/V)
  int lk;       // keys (seqused_k when given)
  int lk_rows;  // key rows of k / v it owns (>= lk: the backward zeroes dK/dV past lk)
  int diag;     // the band's diagonal offset
};

// cu_q / cu_k / used: the varlen index vectors (read only when varlen / has_used).
inline Seq seq_of(constant FlashFwdParams& p, int b, bool varlen, bool paged, bool has_used,
                  const device int* cu_q, const device int* cu_k, const device int* used) {
  Seq s;
  if (!varlen) {
    s.bt = b;
    s.q0 = 0;
    s.lq = p.seqlen_q;
    s.k0 = 0;
    s.lk = p.seqlen_k;
    s.lk_rows = p.seqlen_k;
    s.diag = p.diag_offset;
    return s;
  }
  s.bt = 0;
  s.q0 = clamp(cu_q[b], 0, p.seqlen_q);
  s.lq = min(clamp(cu_q[b + 1], s.q0, p.seqlen_q) - s.q0, p.max_seqlen_q);
  if (paged) {
    const int capacity = p.max_blocks * p.page_size;
    s.k0 = 0;
    s.lk_rows = min(clamp(cu_k[b + 1] - cu_k[b], 0, capacity), p.max_seqlen_k);
  } else {
    s.k0 = clamp(cu_k[b], 0, p.seqlen_k);
    s.lk_rows = min(clamp(cu_k[b + 1], s.k0, p.seqlen_k) - s.k0, p.max_seqlen_k);
  }
  s.lk = has_used ? clamp(used[b], 0, s.lk_rows) : s.lk_rows;
  s.diag = p.diag_offset + s.lk - s.lq;
  return s;
}

// Paged K/V: the element offset of key `pos` of a sequence (its block-table
// row bt_row) in a (num_blocks, Hkv, page_size, D)-indexed cache; a block
// index out of range is clamped (memory safety; debug mode validates).
inline long paged_row(const device int* bt_row, int pos, int page, int num_blocks, long stride_b,
                      long stride_l) {
  const int blk = clamp(bt_row[pos / page], 0, num_blocks - 1);
  return long(blk) * stride_b + long(pos % page) * stride_l;
}

// Tile loader for paged K/V: ROWS x COLS elements of keys kb.. (row
// addresses through the block table), zero past rows_valid / cols_valid.
template <typename T, int ROWS, int COLS, int NT>
inline void load_tile_paged(threadgroup T* dst, int dst_ld, const device T* base, long stride_b, long stride_l,
                            const device int* bt_row, int page, int num_blocks, int kb, int rows_valid,
                            int cols_valid, ushort tid) {
  for (int idx = tid; idx < ROWS * COLS; idx += NT) {
    const int r = idx / COLS;
    const int c = idx - r * COLS;
    T x = T(0.0f);
    if (r < rows_valid && c < cols_valid) {
      x = base[paged_row(bt_row, kb + r, page, num_blocks, stride_b, stride_l) + c];
    }
    dst[r * dst_ld + c] = x;
  }
}

// ---------------------------------------------------------------------------
// Dropout: Philox 4x32-10 (Salmon et al. 2011, Random123), keyed by the
// call's (seed, offset) and counted by (batch entry, head, row, column), so
// the backward regenerates the forward's mask without storing it.  Element
// (i, j) of batch entry b, head h takes word j % 4 of
//   philox(counter = (j / 4, i, b * Hq + h, offset_lo), key = (seed_lo, seed_hi ^ offset_hi))
// and is dropped when that word is below p * 2^32 (torch_metal_flash/philox.py
// is the same generator on the host: the reference path and the tests).
// ---------------------------------------------------------------------------
inline uint4 philox4x32_10(uint4 ctr, uint2 key) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      key.x += 0x9E3779B9u;
      key.y += 0xBB67AE85u;
    }
    const ulong p0 = ulong(0xD2511F53u) * ulong(ctr.x);
    const ulong p1 = ulong(0xCD9E8D57u) * ulong(ctr.z);
    ctr = uint4(uint(p1 >> 32) ^ ctr.y ^ key.x, uint(p1), uint(p0 >> 32) ^ ctr.w ^ key.y, uint(p0));
  }
  return ctr;
}

struct Dropout {
  uint2 key;
  uint offset;
  uint bh;
  uint threshold;

  // Whether elements (i, j) and (i, j + 1) are kept, j even (a lane's two
  // fragment columns: one Philox call).
  void keep2(int i, int j, thread bool& k0, thread bool& k1) const {
    const uint4 w = philox4x32_10(uint4(uint(j) >> 2, uint(i), bh, offset), key);
    const bool lo = (j & 2) == 0;
    k0 = (lo ? w.x : w.z) >= threshold;
    k1 = (lo ? w.y : w.w) >= threshold;
  }

  bool keep(int i, int j) const {
    const uint4 w = philox4x32_10(uint4(uint(j) >> 2, uint(i), bh, offset), key);
    const int e = j & 3;
    return (e == 0 ? w.x : e == 1 ? w.y : e == 2 ? w.z : w.w) >= threshold;
  }
};

// rng = (seed, offset) as two int64 (the op's rng_state); b, h: batch entry and query head.
inline Dropout dropout_of(const device long* rng, int b, int heads, int h, uint threshold) {
  const ulong seed = ulong(rng[0]);
  const ulong offset = ulong(rng[1]);
  Dropout d;
  d.key = uint2(uint(seed), uint(seed >> 32) ^ uint(offset >> 32));
  d.offset = uint(offset);
  d.bh = uint(b) * uint(heads) + uint(h);
  d.threshold = threshold;
  return d;
}

// The probability written to flash-attn's S_dmask: sign bit set when the
// element is dropped (set on the bits, so that a zero keeps its sign under
// fast math, which may treat -0 as 0).
inline float dropped_sign(float x, bool kept) {
  return as_type<float>(as_type<uint>(x) | (kept ? 0u : 0x80000000u));
}

}  // namespace flash
