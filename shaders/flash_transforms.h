// The score transform: what turns a raw product q.k into the score that
// enters the softmax -- softcap, ALiBi, then the mask, in natural units.
// One definition for the forward, the backward (which must rebuild the
// forward's probabilities bit for bit) and the decode kernels.
#pragma once

#include <metal_stdlib>

using namespace metal;

namespace flash {

constant constexpr float kLog2e = 1.4426950408889634f;
constant constexpr float kLn2 = 0.6931471805599453f;

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

// Mask element kinds (function constant mask_kind).
enum MaskKind : int {
  kMaskNone = 0,
  kMaskBool = 1,  // 1 byte, nonzero = visible
  kMaskF32 = 2,
  kMaskF16 = 3,
  kMaskBF16 = 4,
};

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

// The optional transforms a kernel applies: its function constants (and, for
// the decode kernel, the mask kind from its params).
struct ScoreFeatures {
  bool softcap;
  bool alibi;
  bool mask;
  int mask_kind;  // MaskKind, read when `mask`
};

struct Score {
  float s;   // the score in natural units
  float th;  // tanh(x) with softcap (its chain rule needs it), else 0
};

// The score of element (i, j) from x = q.k with q pre-scaled by qk_scale
// (scale, or scale / cap with softcap): x = cap * tanh(x); x -= slope |i + diag - j|;
// x += bias, or visible iff the bool mask.  `vis` (bounds, band) is and-ed
// with the mask, whose element at mask_off is read only when vis and mask_ok
// (rows past the problem's read nothing).
__attribute__((always_inline)) inline
Score transform_score(float x, int i, int j, int diag, float slope, float cap, ScoreFeatures f,
                      const device uchar* mask, long mask_off, bool mask_ok, thread bool& vis) {
  Score r;
  r.th = 0.0f;
  float s = x;
  if (f.softcap) {
    r.th = tanh_stable(x);  // finite for any x under fast math
    s = r.th * cap;
  }
  if (f.alibi) s -= slope * float(abs(i + diag - j));
  if (f.mask && vis && mask_ok) {
    if (f.mask_kind == kMaskBool) {
      vis = mask[mask_off] != 0;
    } else {
      // a -inf entry hides the score (tested on its bits: no infinity in the
      // arithmetic under fast math)
      bool neg_inf;
      s += read_float_mask(mask, mask_off, f.mask_kind, neg_inf);
      vis = !neg_inf;
    }
  }
  r.s = s;
  return r;
}

}  // namespace flash
