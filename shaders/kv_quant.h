// Quantized KV-cache storage: the one definition of the formats on the GPU,
// shared by the decode kernel (flash_decode.metal: dequantize tiles in
// registers) and the append kernel (kvcache_append.metal: quantize rows as
// they are written).  The host side is torch_metal_flash/quant.py; both
// follow the same float32 arithmetic, so a row quantized here equals
// tmf.quantize() of it bit for bit.
//
// A row of D values of logical type T is stored in groups of gs consecutive
// values (the last group may be shorter):
//   affine (bits 4 or 8): D * bits / 32 uint words, element j in bits
//     (j % (32 / bits)) * bits and up of word j / (32 / bits) (MLX packing);
//     per group a scale and a bias of type T; x = scale * q + bias, q in [0, 2^bits - 1].
//   symmetric: D int8 values (read and written as D / 4 uint words, little
//     endian); per group a half scale; x = scale * q, q in [-127, 127].
// Quantizing a group: affine bias = min (exact in T), scale = (max - min) /
// (2^bits - 1) rounded up to T, q = rint((x - bias) / scale); symmetric scale
// = max|x| / 127 rounded up to half (at most 65504), q = clamp(rint(x / scale),
// -127, 127); q = 0 when the scale is 0.  Dequantizing: scale * q (+ bias) in
// float, rounded once to T.
//
// Rows are addressed by a row index (the caches' strides in rows): a row's
// words start at row * words_per_row, its scales (biases) at row * groups.
#pragma once

#include <metal_stdlib>

using namespace metal;

namespace kvq {

// The bit pattern one ulp above h (h finite; 0 and -0 step to the smallest subnormal).
inline half next_up(half h) {
  const ushort b = as_type<ushort>(h);
  if ((b & 0x7fff) == 0) return as_type<half>(ushort(1));
  return as_type<half>(ushort(h > half(0.0f) ? b + 1 : b - 1));
}

inline bfloat next_up(bfloat h) {
  const ushort b = as_type<ushort>(h);
  if ((b & 0x7fff) == 0) return as_type<bfloat>(ushort(1));
  return as_type<bfloat>(ushort(float(h) > 0.0f ? b + 1 : b - 1));
}

inline float next_up(float h) {
  return h;  // scales of float32 tensors are float32: nothing to round
}

// x rounded to T toward +inf.
template <typename T>
inline T round_up(float x) {
  T h = T(x);
  if (float(h) < x) h = next_up(h);
  return h;
}

struct Format {
  bool symmetric;
  int bits;   // 4 or 8 (symmetric: 8)
  int gs;     // group size
  int D;      // values per row
  int per_word;  // values per uint word
  int words;     // words per row
  int groups;    // groups per row

  static Format make(bool symmetric, int bits, int gs, int D) {
    Format f;
    f.symmetric = symmetric;
    f.bits = symmetric ? 8 : bits;
    f.gs = gs;
    f.D = D;
    f.per_word = 32 / f.bits;
    f.words = D / f.per_word;
    f.groups = (D + gs - 1) / gs;
    return f;
  }
};

// ---------------------------------------------------------------------------
// Decode: dequantize the K or V rows of a tile into threadgroup memory.
//
// Tile row r (< rows) holds cache row row_idx[r] (-1: not a key; zeros);
// columns [0, D) are written as T, columns [D, ld) are left alone (the caller
// zeroes them once).  Each word is read from device memory once; each group's
// scale (and bias) is read by the first lane that holds a word of it and
// shuffled to the others, so it is read once per tile row (again only when a
// group straddles two simdgroups).  Every thread of the threadgroup calls
// this; the loop is uniform per simdgroup (the shuffles see all 32 lanes).
// ---------------------------------------------------------------------------
template <typename T>
inline void load_quantized_rows(threadgroup T* tile, int ld, const threadgroup long* row_idx, int rows,
                                Format f, const device uint* words, const device T* scales,
                                const device T* biases, const device half* sym_scales, int nthreads,
                                ushort sg, ushort lane) {
  const int total = rows * f.words;
  const int words_per_group = f.gs / f.per_word;
  const uint mask = (1u << f.bits) - 1u;
  for (int base = int(sg) * 32; base < total; base += nthreads) {
    const int idx = base + int(lane);
    const bool valid = idx < total;
    const int r = valid ? idx / f.words : 0;
    const int w = valid ? idx - r * f.words : 0;
    const long row = valid ? row_idx[r] : -1L;
    const int g = w / words_per_group;
    const int into_group = w - g * words_per_group;  // words of this group before mine (same row)
    const bool loads = into_group == 0 || lane == 0;
    float s = 0.0f;
    float bias = 0.0f;
    if (loads && row >= 0) {
      const long at = row * f.groups + g;
      if (f.symmetric) {
        s = float(sym_scales[at]);
      } else {
        s = float(scales[at]);
        bias = float(biases[at]);
      }
    }
    const ushort src = ushort(into_group <= int(lane) ? int(lane) - into_group : 0);
    s = simd_shuffle(s, src);
    if (!f.symmetric) bias = simd_shuffle(bias, src);
    if (!valid) continue;
    threadgroup T* out = tile + r * ld + w * f.per_word;
    if (row < 0) {
      for (int j = 0; j < f.per_word; ++j) out[j] = T(0.0f);
      continue;
    }
    const uint word = words[row * f.words + w];
    if (f.symmetric) {
      for (int j = 0; j < 4; ++j) {
        const int q = int(word << (24 - 8 * j)) >> 24;  // sign-extended byte j
        out[j] = T(s * float(q));
      }
    } else {
      for (int j = 0; j < f.per_word; ++j) {
        out[j] = T(s * float((word >> (j * f.bits)) & mask) + bias);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Append: quantize one row, thread c holding element c (x, valid = c < D),
// at least 32 * ceil(D / 32) threads (whole simdgroups), and write its words, scales (and biases) at row
// index `row`.  red: 64 floats of threadgroup memory (two per simdgroup, up to 32).
// Contains a threadgroup barrier: every thread calls it.
// ---------------------------------------------------------------------------
template <typename T>
inline void quantize_row(float x, int c, Format f, long row, device uint* words, device T* scales,
                         device T* biases, device half* sym_scales, threadgroup float* red, ushort sg,
                         ushort lane, int nsg) {
  const bool valid = c < f.D;
  const float big = 3.4028234663852886e38f;  // FLT_MAX: finite sentinels (fast math)
  if (f.symmetric) {
    const float amax = simd_max(valid ? abs(x) : 0.0f);
    if (lane == 0) red[sg] = amax;
  } else {
    const float lo = simd_min(valid ? x : big);
    const float hi = simd_max(valid ? x : -big);
    if (lane == 0) {
      red[sg] = lo;
      red[32 + sg] = hi;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // The simdgroups of my group: groups are 32, 64 or 128 values, simdgroups 32.
  const int g = c / f.gs;
  const int sg0 = g * f.gs / 32;
  const int sg1 = min(sg0 + f.gs / 32, nsg);
  int q = 0;
  float s = 0.0f;
  float bias = 0.0f;
  if (f.symmetric) {
    float amax = 0.0f;
    for (int k = sg0; k < sg1; ++k) amax = max(amax, red[k]);
    s = min(float(round_up<half>(precise::divide(amax, 127.0f))), 65504.0f);
    if (valid && s > 0.0f) q = int(clamp(rint(precise::divide(x, s)), -127.0f, 127.0f));
  } else {
    float lo = big;
    float hi = -big;
    for (int k = sg0; k < sg1; ++k) {
      lo = min(lo, red[k]);
      hi = max(hi, red[32 + k]);
    }
    const float n = float((1 << f.bits) - 1);
    bias = lo;
    s = float(round_up<T>(precise::divide(hi - lo, n)));
    if (valid && s > 0.0f) q = int(clamp(rint(precise::divide(x - bias, s)), 0.0f, n));
  }
  // Pack: lanes c .. c + per_word - 1 OR their bits into the word of lane c.
  const int pos = c % f.per_word;
  uint bits = valid ? (uint(q) & ((1u << f.bits) - 1u)) << (pos * f.bits) : 0u;
  for (int k = 1; k < f.per_word; k <<= 1) bits |= simd_shuffle_down(bits, ushort(k));
  if (!valid) return;
  if (pos == 0) words[row * f.words + c / f.per_word] = bits;
  if (c % f.gs == 0) {
    const long at = row * f.groups + g;
    if (f.symmetric) {
      sym_scales[at] = half(s);
    } else {
      scales[at] = T(s);
      biases[at] = T(bias);
    }
  }
}

}  // namespace kvq
