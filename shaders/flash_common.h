// The FlashAttention kernels' shared pieces (forward, backward, decode):
// the headers of fragments, tile loaders, score transform and online softmax,
// plus the band, a batch entry's rows and keys, and dropout.  Plain MSL;
// every pointer carries its address space.
#pragma once

#include <metal_stdlib>
#include "flash_frag.h"
#include "flash_loader.h"
#include "flash_params.h"
#include "flash_softmax.h"
#include "flash_transforms.h"

using namespace metal;

namespace flash {

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

  // Whether elements (i, j) .. (i, j + 3) are kept, j a multiple of 4 (one Philox call).
  bool4 keep4(int i, int j) const {
    const uint4 w = philox4x32_10(uint4(uint(j) >> 2, uint(i), bh, offset), key);
    return bool4(w.x >= threshold, w.y >= threshold, w.z >= threshold, w.w >= threshold);
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
