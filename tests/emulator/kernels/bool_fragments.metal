// A tiled-library idiom the emulator must accept: a fragment type that is
// `metal::vec<T, N>` instantiated with T = bool (a boolean mask tile), loaded
// from a bool buffer and used to select scores.  C++ for OpenCL has no bool
// vectors, so the emulator compiles this file with one byte per lane (boolN).
#include <metal_stdlib>
using namespace metal;

template <typename T>
struct Frag {
  static constant constexpr int kElems = 2;
  typedef metal::vec<T, kElems> frag_type;

  template <typename SrcPtr>
  METAL_FUNC static void load(thread frag_type& dst, SrcPtr src, int lim) {
    for (short j = 0; j < kElems; j++) {
      dst[j] = j < lim ? static_cast<T>(src[j]) : T(0);
    }
  }
};

template <typename T, typename MaskT>
[[kernel]] void masked_scores(const device T* scores [[buffer(0)]],
                              const device MaskT* mask [[buffer(1)]],
                              device T* out [[buffer(2)]],
                              constant int& n [[buffer(3)]],
                              uint gid [[thread_position_in_grid]]) {
  const int base = int(gid) * Frag<MaskT>::kElems;
  typename Frag<T>::frag_type s;
  typename Frag<MaskT>::frag_type m = typename Frag<MaskT>::frag_type(0);
  Frag<T>::load(s, scores + base, n - base);
  Frag<MaskT>::load(m, mask + base, n - base);
  constexpr bool is_bool = is_same_v<MaskT, bool>;
  for (short j = 0; j < Frag<T>::kElems; j++) {
    if (base + j >= n) break;
    if (is_bool) {
      out[base + j] = m[j] ? s[j] : T(-1000);
    } else {
      out[base + j] = s[j] + T(m[j]);
    }
  }
  static_assert(sizeof(typename Frag<bool>::frag_type) == 2, "one byte per bool lane, as on the GPU");
}

template [[host_name("masked_scores_bool")]] [[kernel]] void masked_scores<float, bool>(
    const device float*, const device bool*, device float*, constant int&, uint);
template [[host_name("masked_scores_float")]] [[kernel]] void masked_scores<float, float>(
    const device float*, const device float*, device float*, constant int&, uint);
