// The online softmax in float32 and natural units, shared by the forward and
// decode kernels: the per-block step over a simdgroup's 8 rows and the
// epilogue's row decisions (saw a key, 1 / l, lse).
#pragma once

#include <metal_stdlib>
#include "flash_frag.h"
#include "flash_transforms.h"

using namespace metal;

namespace flash {

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

// One key block of the online softmax for a lane's row (running max m, sum l;
// m = -FLT_MAX while the row has seen nothing).  S holds the block's scores,
// -FLT_MAX where hidden (bit 2 * kk + e of `hidden`: element e of S[kk]),
// and becomes P = exp(S - m_new) in place, 0 where hidden; l and the NF
// output fragments O are rescaled by exp(m - m_new).  The rows are shared by
// the 4 lanes xor 1 and xor 8.  always_inline (as every shared piece on a hot
// path): inlined before it is optimised on its own, so that under fast math its
// sums are reassociated in the caller's context, exactly as code written in place.
template <int NK, int NF>
__attribute__((always_inline)) inline
void softmax_step(thread simdgroup_float8x8* S, uint hidden, thread float& m_i, thread float& l_i,
                  thread simdgroup_float8x8* Of) {
  float mx = -FLT_MAX;
  for (int kk = 0; kk < NK; ++kk) {
    mx = max(mx, max(S[kk].thread_elements()[0], S[kk].thread_elements()[1]));
  }
  mx = row_max(mx);
  const float m_new = max(m_i, mx);
  const float factor = exp_shifted(m_i - m_new);
  float rs = 0.0f;
  for (int kk = 0; kk < NK; ++kk) {
    const float p0 = (hidden >> (2 * kk)) & 1u ? 0.0f : exp_shifted(S[kk].thread_elements()[0] - m_new);
    const float p1 = (hidden >> (2 * kk + 1)) & 1u ? 0.0f : exp_shifted(S[kk].thread_elements()[1] - m_new);
    rs += p0 + p1;
    S[kk].thread_elements()[0] = p0;
    S[kk].thread_elements()[1] = p1;
  }
  rs = row_sum(rs);
  l_i = l_i * factor + rs;
  m_i = m_new;
  for (int dd = 0; dd < NF; ++dd) frag_scale(Of[dd], factor);
}

}  // namespace flash
