// Glue between the runtime and a kernel function: binds each parameter from
// the thread's MtlThreadInfo (buffers, threadgroup memory, built-ins) with the
// exact C++ type the kernel declares, describes those types to Python, and
// checks the types of built-in parameters.  Used by the code the pre-pass
// appends to the build translation unit only.
#pragma once
#pragma clang system_header
#ifndef __MTL_RULES__

#define MTL_EXPORT extern "C" __attribute__((visibility("default")))

namespace __mtl {

template <int... I> struct int_seq {};
template <class T, T... I> struct to_seq { using type = int_seq<I...>; };
template <int N> using make_int_seq = typename __make_integer_seq<to_seq, int, N>::type;

// The argument for a parameter of type P: pointers and references as
// declared, values without their (__private) address space.
template <class P> using arg_t = conditional_t<__is_pointer(P) || __is_reference(P), P, plain_t<P>>;

template <class P>
MTL_INLINE arg_t<P> bind_arg(MtlThreadInfo* ti, int kind, int index) {
  if constexpr (__is_pointer(P)) {
    return (P)(uintptr_t)(kind == MTL_P_THREADGROUP ? ti->tg_params[index] : ti->buffers[index]);
  } else if constexpr (__is_reference(P)) {
    return *(metal::remove_reference_t<P>*)(uintptr_t)ti->buffers[index];
  } else {
    using V = plain_t<P>;
    if (kind == MTL_P_BUFFER) return *(const V*)ti->buffers[index];
    using E = elem_t<V>;
    const uint32_t* v = ti->builtin[index];
    if constexpr (vn<V> == 1) return (V)v[0];
    else if constexpr (vn<V> == 2) return V{(E)v[0], (E)v[1]};
    else if constexpr (vn<V> == 3) return V{(E)v[0], (E)v[1], (E)v[2]};
    else return V{(E)v[0], (E)v[1], (E)v[2], (E)0};
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

template <class T> inline constexpr constant bool in_constant = false;
template <class T> inline constexpr constant bool in_constant<__constant T> = true;

template <class P>
MtlParamInfo param_info() {
  MtlParamInfo r;
  using Q = metal::remove_addrspace_t<metal::remove_pointer_t<metal::remove_reference_t<P>>>;
  r.is_pointer = __is_pointer(P);
  r.is_reference = __is_reference(P);
  r.type_code = type_code<Q>();
  if constexpr (__is_void(Q)) r.size = 1;  // device const void* (a byte buffer)
  else r.size = (int)sizeof(Q);
  r.is_const = __is_const(Q) || in_constant<metal::remove_pointer_t<metal::remove_reference_t<P>>>;
  return r;
}

template <class... P>
int describe(void (*)(P...), MtlParamInfo* out) {
  int i = 0;
  ((out[i++] = param_info<P>()), ...);
  return (int)sizeof...(P);
}

// The I-th parameter type of function type F.
template <int I, class F> struct param;
template <int I, class P0, class... P> struct param<I, void(P0, P...)> : param<I - 1, void(P...)> {};
template <class P0, class... P> struct param<0, void(P0, P...)> { typedef P0 type; };
template <int I, class F> using param_t = typename param<I, F>::type;

// Built-in parameter types: positions and sizes are uint / ushort scalars or
// 2-, 3-vectors; indices and counts are uint / ushort scalars.
template <class P> inline constexpr constant bool builtin_index_ok = __is_same(plain_t<P>, uint) || __is_same(plain_t<P>, ushort);
// Buffer and threadgroup parameters: a pointer or reference names its address
// space (an unqualified one would be thread memory, which no argument table
// can bind); a parameter passed by value is not checked here.
template <class T> inline constexpr constant bool in_device_or_constant = false;
template <class T> inline constexpr constant bool in_device_or_constant<__global T> = true;
template <class T> inline constexpr constant bool in_device_or_constant<__constant T> = true;
template <class T> inline constexpr constant bool in_threadgroup = false;
template <class T> inline constexpr constant bool in_threadgroup<__local T> = true;
template <class P> using pointee_t = metal::remove_pointer_t<metal::remove_reference_t<P>>;
template <class P> inline constexpr constant bool indirect = __is_pointer(P) || __is_reference(P);
template <class P> inline constexpr constant bool buffer_param_ok = !indirect<P> || in_device_or_constant<pointee_t<P>>;
template <class P> inline constexpr constant bool threadgroup_param_ok = indirect<P> && in_threadgroup<pointee_t<P>>;

template <class P> inline constexpr constant bool builtin_position_ok =
    vn<P> <= 3 && (__is_same(elem_t<P>, uint) || __is_same(elem_t<P>, ushort));

// Function constant values, set before each launch (see the pre-pass).
template <class T>
MTL_INLINE T fc_value(const long* iv, const float* dv, int i) {
  if constexpr (__is_floating_point(T)) return (T)dv[i];
  else return (T)iv[i];
}

}  // namespace __mtl
#endif
