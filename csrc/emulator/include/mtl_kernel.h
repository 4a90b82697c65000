// Glue between the runtime and a kernel function: binds each parameter from
// the thread's MtlThreadInfo (buffers, threadgroup memory, built-ins) with the
// exact C++ type the kernel declares, and describes those types to Python.
#pragma once

#define MTL_EXPORT extern "C" __attribute__((visibility("default")))

namespace __mtl {

template <int... I> struct int_seq {};
template <class T, T... I> struct __to_seq { using type = int_seq<I...>; };
template <int N> using make_int_seq = typename __make_integer_seq<__to_seq, int, N>::type;

template <class P>
MTL_INLINE P bind_arg(MtlThreadInfo* ti, int kind, int index) {
  if constexpr (metal::is_pointer_v<P>) {
    return (P)(kind == MTL_P_THREADGROUP ? ti->tg_params[index] : ti->buffers[index]);
  } else if constexpr (metal::is_reference_v<P>) {
    return *(metal::remove_reference_t<P>*)ti->buffers[index];
  } else if (kind == MTL_P_BUFFER) {
    return *(const P*)ti->buffers[index];
  } else {
    using E = metal::__elem_t<P>;
    const uint32_t* v = ti->builtin[index];
    if constexpr (vn<P> == 1) return (P)v[0];
    else if constexpr (vn<P> == 2) return P{(E)v[0], (E)v[1]};
    else if constexpr (vn<P> == 3) return P{(E)v[0], (E)v[1], (E)v[2]};
    else return P{(E)v[0], (E)v[1], (E)v[2], (E)0};
  }
}

template <class... P, int... I>
MTL_INLINE void call_kernel(void (*f)(P...), MtlThreadInfo* ti, const MtlParamSpec* s, int_seq<I...>) {
  f(bind_arg<P>(ti, s[I].kind, s[I].index)...);
}

template <class... P>
MTL_INLINE void invoke(void (*f)(P...), MtlThreadInfo* ti, const MtlParamSpec* s) {
  call_kernel(f, ti, s, make_int_seq<sizeof...(P)>{});
}

template <class P>
MtlParamInfo param_info() {
  MtlParamInfo r;
  using V = metal::remove_cv_t<metal::remove_pointer_t<metal::remove_reference_t<P>>>;
  r.is_pointer = metal::is_pointer_v<P>;
  r.is_reference = metal::is_reference_v<P>;
  r.type_code = type_code<V>();
  r.size = (int)sizeof(V);
  r.is_const = metal::is_const_v<metal::remove_pointer_t<metal::remove_reference_t<P>>>;
  return r;
}

template <class... P>
int describe(void (*)(P...), MtlParamInfo* out) {
  int i = 0;
  ((out[i++] = param_info<P>()), ...);
  return (int)sizeof...(P);
}

// Function constant values, set before each launch (see the pre-pass).
template <class T>
MTL_INLINE T fc_value(const long* iv, const double* dv, int i) {
  if constexpr (metal::is_floating_point_v<T>) return (T)dv[i];
  else return (T)iv[i];
}

}  // namespace __mtl
