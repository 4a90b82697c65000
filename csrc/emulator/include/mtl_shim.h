// The Metal Shading Language, as far as compute kernels use it, on top of
// C++20 and clang extensions.  Included first into every kernel translation
// unit (after the emulator's text pre-pass).  No libc / libstdc++ headers:
// they would make math calls like exp() ambiguous.
#pragma once
#include "../mtl_abi.h"

#define __METAL_EMULATOR__ 1

// ---- address spaces: plain memory on the CPU
#define device
#define threadgroup
#define thread
#define constant const
#define threadgroup_imageblock
#define ray_data
#define object_data

#define MTL_INLINE inline __attribute__((always_inline))
// Collective completions run in the scheduler on lane-private data: no access callbacks.
#define MTL_RUNTIME_SIDE __attribute__((noinline, no_sanitize("coverage")))

extern "C" {
void __mtl_rt_collective(MtlCollRec* r);
void* __mtl_rt_tg_alloc(const void* key, uint64_t size, uint64_t align, const char* file, uint32_t line);
int __mtl_rt_atomic(void* addr, int op, int type, const void* val, void* cmp, void* out);
void __mtl_rt_fail(int code, const char* msg, const char* file, uint32_t line);
uint32_t __mtl_rt_lane(void);
}

namespace metal {

// ---------------------------------------------------------------- scalar and vector types
typedef _Float16 half;
typedef __bf16 bfloat;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef __SIZE_TYPE__ size_t;
typedef __PTRDIFF_TYPE__ ptrdiff_t;
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long int64_t;
typedef unsigned long uint64_t;
typedef __INTPTR_TYPE__ intptr_t;
typedef __UINTPTR_TYPE__ uintptr_t;

template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));

#define MTL_VEC(T, name)                                                 \
  typedef T name##2 __attribute__((ext_vector_type(2)));                 \
  typedef T name##3 __attribute__((ext_vector_type(3)));                 \
  typedef T name##4 __attribute__((ext_vector_type(4)));                 \
  typedef T packed_##name##2 __attribute__((ext_vector_type(2), aligned(sizeof(T)))); \
  typedef T packed_##name##4 __attribute__((ext_vector_type(4), aligned(sizeof(T))));
MTL_VEC(bool, bool)
MTL_VEC(char, char)
MTL_VEC(uchar, uchar)
MTL_VEC(short, short)
MTL_VEC(ushort, ushort)
MTL_VEC(int, int)
MTL_VEC(uint, uint)
MTL_VEC(long, long)
MTL_VEC(ulong, ulong)
MTL_VEC(half, half)
MTL_VEC(bfloat, bfloat)
MTL_VEC(float, float)
#undef MTL_VEC

// packed 3-vectors are 3 elements in memory (ext vectors of 3 take 4 slots).
template <class T>
struct packed_vec3 {
  T x, y, z;
  packed_vec3() = default;
  MTL_INLINE packed_vec3(vec<T, 3> v) : x(v.x), y(v.y), z(v.z) {}
  MTL_INLINE operator vec<T, 3>() const { return vec<T, 3>{x, y, z}; }
  MTL_INLINE T& operator[](int i) { return (&x)[i]; }
  MTL_INLINE const T& operator[](int i) const { return (&x)[i]; }
};
typedef packed_vec3<char> packed_char3;
typedef packed_vec3<uchar> packed_uchar3;
typedef packed_vec3<short> packed_short3;
typedef packed_vec3<ushort> packed_ushort3;
typedef packed_vec3<int> packed_int3;
typedef packed_vec3<uint> packed_uint3;
typedef packed_vec3<half> packed_half3;
typedef packed_vec3<bfloat> packed_bfloat3;
typedef packed_vec3<float> packed_float3;

// ---------------------------------------------------------------- type traits
template <class T, T v> struct integral_constant { static constexpr T value = v; using value_type = T; constexpr operator T() const { return v; } };
typedef integral_constant<bool, true> true_type;
typedef integral_constant<bool, false> false_type;
template <bool B> using bool_constant = integral_constant<bool, B>;
template <class A, class B> struct is_same : false_type {};
template <class A> struct is_same<A, A> : true_type {};
template <class A, class B> inline constexpr bool is_same_v = is_same<A, B>::value;
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { using type = T; };
template <bool B, class T = void> using enable_if_t = typename enable_if<B, T>::type;
template <bool B, class T, class F> struct conditional { using type = T; };
template <class T, class F> struct conditional<false, T, F> { using type = F; };
template <bool B, class T, class F> using conditional_t = typename conditional<B, T, F>::type;
template <class T> struct remove_const { using type = T; };
template <class T> struct remove_const<const T> { using type = T; };
template <class T> struct remove_volatile { using type = T; };
template <class T> struct remove_volatile<volatile T> { using type = T; };
template <class T> struct remove_cv { using type = typename remove_const<typename remove_volatile<T>::type>::type; };
template <class T> using remove_cv_t = typename remove_cv<T>::type;
template <class T> using remove_const_t = typename remove_const<T>::type;
template <class T> using remove_volatile_t = typename remove_volatile<T>::type;
template <class T> struct remove_reference { using type = T; };
template <class T> struct remove_reference<T&> { using type = T; };
template <class T> struct remove_reference<T&&> { using type = T; };
template <class T> using remove_reference_t = typename remove_reference<T>::type;
template <class T> struct remove_pointer { using type = T; };
template <class T> struct remove_pointer<T*> { using type = T; };
template <class T> struct remove_pointer<T* const> { using type = T; };
template <class T> using remove_pointer_t = typename remove_pointer<T>::type;
template <class T> using remove_cvref_t = remove_cv_t<remove_reference_t<T>>;
template <class T> struct remove_address_space { using type = T; };
template <class T> using remove_address_space_t = T;
template <class T> struct decay { using type = remove_cvref_t<T>; };
template <class T> using decay_t = typename decay<T>::type;
template <class T> struct is_pointer : false_type {};
template <class T> struct is_pointer<T*> : true_type {};
template <class T> struct is_pointer<T* const> : true_type {};
template <class T> inline constexpr bool is_pointer_v = is_pointer<T>::value;
template <class T> struct is_reference : false_type {};
template <class T> struct is_reference<T&> : true_type {};
template <class T> inline constexpr bool is_reference_v = is_reference<T>::value;
template <class T> struct is_const : false_type {};
template <class T> struct is_const<const T> : true_type {};
template <class T> inline constexpr bool is_const_v = is_const<T>::value;
template <class T> struct type_identity { using type = T; };
template <class T> using type_identity_t = typename type_identity<T>::type;
template <class T> T&& declval() noexcept;

template <class T> struct __is_float_impl : false_type {};
template <> struct __is_float_impl<float> : true_type {};
template <> struct __is_float_impl<half> : true_type {};
template <> struct __is_float_impl<bfloat> : true_type {};
template <> struct __is_float_impl<double> : true_type {};
template <class T> struct is_floating_point : __is_float_impl<remove_cv_t<T>> {};
template <class T> inline constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T> struct is_integral : bool_constant<__is_integral(remove_cv_t<T>)> {};
template <class T> inline constexpr bool is_integral_v = is_integral<T>::value;
template <class T> struct is_arithmetic : bool_constant<is_integral_v<T> || is_floating_point_v<T>> {};
template <class T> inline constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T> struct is_scalar : is_arithmetic<T> {};
template <class T> inline constexpr bool is_scalar_v = is_scalar<T>::value;
template <class T> struct is_signed : bool_constant<is_floating_point_v<T> || (is_integral_v<T> && T(-1) < T(0))> {};
template <class T> inline constexpr bool is_signed_v = is_signed<T>::value;
template <class T> struct is_unsigned : bool_constant<is_integral_v<T> && !(T(-1) < T(0))> {};
template <class T> inline constexpr bool is_unsigned_v = is_unsigned<T>::value;
template <class F, class T> struct is_convertible : bool_constant<__is_convertible_to(F, T)> {};
template <class F, class T> inline constexpr bool is_convertible_v = is_convertible<F, T>::value;
template <class T> struct is_empty : bool_constant<__is_empty(T)> {};
template <class T> inline constexpr bool is_empty_v = is_empty<T>::value;
template <class T> struct is_class : bool_constant<__is_class(T)> {};
template <class T> inline constexpr bool is_class_v = is_class<T>::value;
template <class T> struct is_enum : bool_constant<__is_enum(T)> {};
template <class T> inline constexpr bool is_enum_v = is_enum<T>::value;
template <class B, class D> struct is_base_of : bool_constant<__is_base_of(B, D)> {};
template <class B, class D> inline constexpr bool is_base_of_v = is_base_of<B, D>::value;
template <class T> struct is_void : is_same<remove_cv_t<T>, void> {};
template <class T> inline constexpr bool is_void_v = is_void<T>::value;
template <class T> struct is_trivially_copyable : bool_constant<__is_trivially_copyable(T)> {};
template <class T> struct underlying_type { using type = __underlying_type(T); };
template <class T> using underlying_type_t = typename underlying_type<T>::type;
template <class...> using void_t = void;
template <class T> struct make_unsigned { using type = T; };
template <> struct make_unsigned<char> { using type = uchar; };
template <> struct make_unsigned<signed char> { using type = uchar; };
template <> struct make_unsigned<short> { using type = ushort; };
template <> struct make_unsigned<int> { using type = uint; };
template <> struct make_unsigned<long> { using type = ulong; };
template <class T> using make_unsigned_t = typename make_unsigned<T>::type;
template <class T> struct make_signed { using type = T; };
template <> struct make_signed<uchar> { using type = char; };
template <> struct make_signed<ushort> { using type = short; };
template <> struct make_signed<uint> { using type = int; };
template <> struct make_signed<ulong> { using type = long; };
template <class T> using make_signed_t = typename make_signed<T>::type;

// vector traits
template <class T> struct __vt { static constexpr int n = 1; using elem = T; };
template <class T, int N> struct __vt<T __attribute__((ext_vector_type(N)))> { static constexpr int n = N; using elem = T; };
template <class T> struct __vt<packed_vec3<T>> { static constexpr int n = 3; using elem = T; };
template <class T> struct __vt<const T> : __vt<T> {};
template <class T> struct is_vector : bool_constant<(__vt<T>::n > 1)> {};
template <class T> inline constexpr bool is_vector_v = is_vector<T>::value;
template <class T> struct vec_elements { static constexpr int value = __vt<T>::n; };
template <class T> using __elem_t = typename __vt<T>::elem;

template <class T, int N> struct array {
  T _e[N ? N : 1];
  MTL_INLINE T& operator[](size_t i) { return _e[i]; }
  MTL_INLINE const T& operator[](size_t i) const { return _e[i]; }
  static constexpr size_t size() { return N; }
  T* data() { return _e; }
  const T* data() const { return _e; }
};

// ---------------------------------------------------------------- limits and constants
template <class T> struct numeric_limits;
#define MTL_LIMITS_INT(T, MN, MX)                                   \
  template <> struct numeric_limits<T> {                          \
    static constexpr bool is_specialized = true, is_signed = (T)(-1) < (T)0, is_integer = true; \
    static constexpr T min() { return MN; }                        \
    static constexpr T max() { return MX; }                        \
    static constexpr T lowest() { return MN; }                     \
  };
MTL_LIMITS_INT(bool, false, true)
MTL_LIMITS_INT(char, (char)-128, (char)127)
MTL_LIMITS_INT(signed char, (signed char)-128, (signed char)127)
MTL_LIMITS_INT(uchar, 0, 255)
MTL_LIMITS_INT(short, (short)-32768, (short)32767)
MTL_LIMITS_INT(ushort, 0, 65535)
MTL_LIMITS_INT(int, (-2147483647 - 1), 2147483647)
MTL_LIMITS_INT(uint, 0u, 4294967295u)
MTL_LIMITS_INT(long, (-9223372036854775807L - 1), 9223372036854775807L)
MTL_LIMITS_INT(ulong, 0ul, 18446744073709551615ul)
#undef MTL_LIMITS_INT
template <> struct numeric_limits<float> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, has_infinity = true;
  static constexpr float min() { return 1.17549435e-38f; }
  static constexpr float max() { return 3.40282347e+38f; }
  static constexpr float lowest() { return -3.40282347e+38f; }
  static constexpr float epsilon() { return 1.1920929e-07f; }
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float denorm_min() { return 1.40129846e-45f; }
};
template <> struct numeric_limits<half> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, has_infinity = true;
  static constexpr half min() { return (half)6.103515625e-05f; }
  static constexpr half max() { return (half)65504.0f; }
  static constexpr half lowest() { return (half)-65504.0f; }
  static constexpr half epsilon() { return (half)0.0009765625f; }
  static constexpr half infinity() { return (half)__builtin_inff(); }
  static constexpr half quiet_NaN() { return (half)__builtin_nanf(""); }
  static constexpr half denorm_min() { return (half)5.9604644775390625e-08f; }
};
template <> struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, has_infinity = true;
  static constexpr bfloat min() { return __builtin_bit_cast(bfloat, (unsigned short)0x0080); }
  static constexpr bfloat max() { return __builtin_bit_cast(bfloat, (unsigned short)0x7F7F); }
  static constexpr bfloat lowest() { return __builtin_bit_cast(bfloat, (unsigned short)0xFF7F); }
  static constexpr bfloat epsilon() { return __builtin_bit_cast(bfloat, (unsigned short)0x3C00); }
  static constexpr bfloat infinity() { return __builtin_bit_cast(bfloat, (unsigned short)0x7F80); }
  static constexpr bfloat quiet_NaN() { return __builtin_bit_cast(bfloat, (unsigned short)0x7FC0); }
  static constexpr bfloat denorm_min() { return __builtin_bit_cast(bfloat, (unsigned short)0x0001); }
};
template <class T> struct numeric_limits<const T> : numeric_limits<T> {};

// ---------------------------------------------------------------- conversions, as_type
template <class T, class U>
MTL_INLINE T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: source and destination must have the same size");
  return __builtin_bit_cast(T, u);
}

}  // namespace metal

// Internals of the emulator (used by the pre-pass output and the shim).
namespace __mtl {
using namespace ::metal;

struct Site {
  const char* file = __builtin_FILE();
  unsigned line = __builtin_LINE();
  unsigned col = __builtin_COLUMN();
};

template <class T> inline constexpr int vn = metal::__vt<metal::remove_cv_t<T>>::n;

template <class T, class A>
MTL_INLINE T conv(A a) {
  if constexpr (metal::is_same_v<T, bool>) return a != A(0);
  else return static_cast<T>(a);
}

template <class T, int N, class A>
MTL_INLINE void put(vec<T, N>& r, int& i, const A& a) {
  if constexpr (vn<A> == 1) {
    r[i++] = conv<T>(a);
  } else {
    for (int k = 0; k < vn<A>; k++) r[i++] = conv<T>(a[k]);
  }
}

// MSL vector constructors: float4(x) splats, float4(h4) converts,
// float4(f2, z, w) concatenates (the pre-pass rewrites them to this).
template <class T, int N, class... A>
MTL_INLINE vec<T, N> make_vec(const A&... a) {
  if constexpr (sizeof...(A) == 0) {
    return vec<T, N>(T(0));
  } else if constexpr (sizeof...(A) == 1 && ((vn<A> == 1) && ...)) {
    return vec<T, N>(conv<T>(a...));
  } else {
    static_assert((vn<A> + ...) == N, "vector constructor: the components do not add up to the vector size");
    vec<T, N> r;
    int i = 0;
    (put<T, N>(r, i, a), ...);
    return r;
  }
}

// threadgroup variables declared in a function body: one per threadgroup.
template <class T>
MTL_INLINE T& tg_var(const void* key, Site s = {}) {
  return *(T*)__mtl_rt_tg_alloc(key, sizeof(T), alignof(T), s.file, s.line);
}

template <class T>
MTL_INLINE T collective(MtlCollFn fn, const T& x, uint64_t arg, const Site& s, int kind = MTL_C_SIMD) {
  T out;
  MtlCollRec r;
  r.fn = fn;
  r.in = &x;
  r.out = &out;
  r.arg = arg;
  r.in2 = r.in3 = nullptr;
  r.file = s.file;
  r.line = s.line;
  r.col = s.col;
  r.kind = kind;
  __mtl_rt_collective(&r);
  return out;
}

template <class T> MTL_INLINE const T& in(MtlCollRec* const* L, int l) { return *(const T*)L[l]->in; }
template <class T> MTL_INLINE T& out(MtlCollRec* const* L, int l) { return *(T*)L[l]->out; }

template <class T> MTL_INLINE T vmax(T a, T b) {
  if constexpr (vn<T> == 1) return a > b ? a : b;
  else { T r; for (int k = 0; k < vn<T>; k++) r[k] = a[k] > b[k] ? a[k] : b[k]; return r; }
}
template <class T> MTL_INLINE T vmin(T a, T b) {
  if constexpr (vn<T> == 1) return a < b ? a : b;
  else { T r; for (int k = 0; k < vn<T>; k++) r[k] = a[k] < b[k] ? a[k] : b[k]; return r; }
}

// Reductions combine lanes as a butterfly tree, like the hardware.
template <class T, int Op>
MTL_RUNTIME_SIDE void op_reduce(MtlCollRec* const* L, uint32_t m) {
  T v[32];
  bool has[32];
  for (int l = 0; l < 32; l++) { has[l] = (m >> l) & 1; if (has[l]) v[l] = in<T>(L, l); }
  for (int w = 1; w < 32; w *= 2)
    for (int l = 0; l < 32; l += 2 * w) {
      if (!has[l + w]) continue;
      if (!has[l]) { v[l] = v[l + w]; has[l] = true; continue; }
      if constexpr (Op == 0) v[l] = v[l] + v[l + w];
      else if constexpr (Op == 1) v[l] = v[l] * v[l + w];
      else if constexpr (Op == 2) v[l] = vmax(v[l], v[l + w]);
      else if constexpr (Op == 3) v[l] = vmin(v[l], v[l + w]);
      else if constexpr (Op == 4) v[l] = v[l] & v[l + w];
      else if constexpr (Op == 5) v[l] = v[l] | v[l + w];
      else v[l] = v[l] ^ v[l + w];
    }
  for (int l = 0; l < 32; l++)
    if ((m >> l) & 1) out<T>(L, l) = v[0];
}

template <class T, int Op, bool Inclusive>
MTL_RUNTIME_SIDE void op_prefix(MtlCollRec* const* L, uint32_t m) {
  T acc = T(Op == 0 ? 0 : 1);
  for (int l = 0; l < 32; l++) {
    if (!((m >> l) & 1)) continue;
    T x = in<T>(L, l);
    if (!Inclusive) out<T>(L, l) = acc;
    acc = Op == 0 ? acc + x : acc * x;
    if (Inclusive) out<T>(L, l) = acc;
  }
}

// Shuffles: Mode 0 absolute lane, 1 xor, 2 up, 3 down, 4 rotate up, 5 rotate down,
// 6 first active lane.  Width 32 = simdgroup, 4 = quadgroup.
template <class T, int Mode, int Width>
MTL_RUNTIME_SIDE void op_shuffle(MtlCollRec* const* L, uint32_t m) {
  int first = __builtin_ctz(m);
  T vals[32];
  for (int l = 0; l < 32; l++)
    if ((m >> l) & 1) vals[l] = in<T>(L, l);
  for (int l = 0; l < 32; l++) {
    if (!((m >> l) & 1)) continue;
    int base = l / Width * Width, q = l % Width;
    long a = (long)L[l]->arg, src;
    if (Mode == 0) src = base + (a % Width);
    else if (Mode == 1) src = base + ((q ^ a) & (Width - 1));
    else if (Mode == 2) src = q - a >= 0 ? l - a : l;
    else if (Mode == 3) src = q + a < Width ? l + a : l;
    else if (Mode == 4) src = base + ((q - a) % Width + Width) % Width;
    else if (Mode == 5) src = base + (q + a) % Width;
    else src = first;
    out<T>(L, l) = (src >= 0 && src < 32 && ((m >> src) & 1)) ? vals[src] : vals[l];
  }
}

// simd_shuffle_and_fill_{up,down}: lanes past the edge of each group of
// `modulo` lanes read the filling value instead (arg = delta | modulo << 16).
template <class T, bool Down>
MTL_RUNTIME_SIDE void op_fill(MtlCollRec* const* L, uint32_t m) {
  T vals[32], fill[32];
  for (int l = 0; l < 32; l++)
    if ((m >> l) & 1) { vals[l] = in<T>(L, l); fill[l] = *(const T*)L[l]->in2; }
  for (int l = 0; l < 32; l++) {
    if (!((m >> l) & 1)) continue;
    int delta = (int)(L[l]->arg & 0xFFFF), mod = (int)(L[l]->arg >> 16);
    if (mod <= 0 || mod > 32) mod = 32;
    int base = l / mod * mod, q = l % mod;
    int src = Down ? q + delta : q - delta;
    bool inside = Down ? src < mod : src >= 0;
    int s = inside ? base + src : base + (Down ? src - mod : src + mod);
    const T* from = inside ? vals : fill;
    out<T>(L, l) = (s >= 0 && s < 32 && ((m >> s) & 1)) ? from[s] : vals[l];
  }
}

// Quad reductions over each group of four lanes.
template <class T, int Op>
MTL_RUNTIME_SIDE void op_quad_reduce(MtlCollRec* const* L, uint32_t m) {
  for (int q = 0; q < 32; q += 4) {
    bool any = false;
    T acc{};
    for (int l = q; l < q + 4; l++) {
      if (!((m >> l) & 1)) continue;
      T x = in<T>(L, l);
      if (!any) { acc = x; any = true; continue; }
      acc = Op == 0 ? acc + x : Op == 2 ? vmax(acc, x) : Op == 3 ? vmin(acc, x) : acc * x;
    }
    for (int l = q; l < q + 4; l++)
      if ((m >> l) & 1) out<T>(L, l) = acc;
  }
}

// Votes: Op 0 ballot, 1 all, 2 any, 3 is_first, 4 active mask
template <int Op>
MTL_RUNTIME_SIDE void op_vote(MtlCollRec* const* L, uint32_t m) {
  uint64_t ballot = 0;
  for (int l = 0; l < 32; l++)
    if (((m >> l) & 1) && in<bool>(L, l)) ballot |= 1ull << l;
  int first = __builtin_ctz(m);
  for (int l = 0; l < 32; l++) {
    if (!((m >> l) & 1)) continue;
    uint64_t r;
    if (Op == 0) r = ballot;
    else if (Op == 1) r = ballot == (uint64_t)m;
    else if (Op == 2) r = ballot != 0;
    else if (Op == 3) r = l == first;
    else r = m;
    out<uint64_t>(L, l) = r;
  }
}

template <class T> inline constexpr int atomic_type =
    metal::is_same_v<T, float> ? 2 : (sizeof(T) == 8 ? (metal::is_signed_v<T> ? 3 : 4) : (metal::is_signed_v<T> ? 0 : 1));

template <class T> constexpr int type_code() {
  using U = metal::remove_cv_t<T>;
  if constexpr (metal::is_same_v<U, bool>) return MTL_T_BOOL;
  else if constexpr (metal::is_same_v<U, float>) return MTL_T_FLOAT;
  else if constexpr (metal::is_same_v<U, metal::half>) return MTL_T_HALF;
  else if constexpr (metal::is_same_v<U, metal::bfloat>) return MTL_T_BFLOAT;
  else if constexpr (metal::is_same_v<U, double>) return MTL_T_DOUBLE;
  else if constexpr (metal::is_integral_v<U>) return metal::is_signed_v<U> ? MTL_T_SINT : MTL_T_UINT;
  else return MTL_T_OTHER;
}

}  // namespace __mtl

namespace metal {

// ---------------------------------------------------------------- barriers
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                       mem_threadgroup_imageblock = 8, mem_object_data = 16 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((int)a | (int)b); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return (mem_flags)((int)a & (int)b); }

MTL_INLINE void threadgroup_barrier(mem_flags = mem_flags::mem_none, __mtl::Site s = {}) {
  char dummy = 0;
  __mtl::collective<char>(nullptr, dummy, 0, s, MTL_C_TG_BARRIER);
}
MTL_INLINE void simdgroup_barrier(mem_flags = mem_flags::mem_none, __mtl::Site s = {}) {
  char dummy = 0;
  __mtl::collective<char>(nullptr, dummy, 0, s, MTL_C_SIMD_BARRIER);
}
MTL_INLINE void atomic_thread_fence(mem_flags = mem_flags::mem_none, int = 0, int = 0) {}

// ---------------------------------------------------------------- simd collectives
#define MTL_REDUCE(name, op)                                                              \
  template <class T> MTL_INLINE T name(T x, __mtl::Site s = {}) {                        \
    return __mtl::collective<T>(&__mtl::op_reduce<T, op>, x, 0, s);                      \
  }
MTL_REDUCE(simd_sum, 0)
MTL_REDUCE(simd_product, 1)
MTL_REDUCE(simd_max, 2)
MTL_REDUCE(simd_min, 3)
MTL_REDUCE(simd_and, 4)
MTL_REDUCE(simd_or, 5)
MTL_REDUCE(simd_xor, 6)
#undef MTL_REDUCE

template <class T> MTL_INLINE T simd_prefix_inclusive_sum(T x, __mtl::Site s = {}) { return __mtl::collective<T>(&__mtl::op_prefix<T, 0, true>, x, 0, s); }
template <class T> MTL_INLINE T simd_prefix_exclusive_sum(T x, __mtl::Site s = {}) { return __mtl::collective<T>(&__mtl::op_prefix<T, 0, false>, x, 0, s); }
template <class T> MTL_INLINE T simd_prefix_inclusive_product(T x, __mtl::Site s = {}) { return __mtl::collective<T>(&__mtl::op_prefix<T, 1, true>, x, 0, s); }
template <class T> MTL_INLINE T simd_prefix_exclusive_product(T x, __mtl::Site s = {}) { return __mtl::collective<T>(&__mtl::op_prefix<T, 1, false>, x, 0, s); }

#define MTL_SHUF(name, mode, width)                                                                   \
  template <class T> MTL_INLINE T name(T x, ushort arg, __mtl::Site s = {}) {                        \
    return __mtl::collective<T>(&__mtl::op_shuffle<T, mode, width>, x, arg, s);                      \
  }
MTL_SHUF(simd_shuffle, 0, 32)
MTL_SHUF(simd_broadcast, 0, 32)
MTL_SHUF(simd_shuffle_xor, 1, 32)
MTL_SHUF(simd_shuffle_up, 2, 32)
MTL_SHUF(simd_shuffle_down, 3, 32)
MTL_SHUF(simd_shuffle_rotate_up, 4, 32)
MTL_SHUF(simd_shuffle_rotate_down, 5, 32)
MTL_SHUF(quad_shuffle, 0, 4)
MTL_SHUF(quad_broadcast, 0, 4)
MTL_SHUF(quad_shuffle_xor, 1, 4)
MTL_SHUF(quad_shuffle_up, 2, 4)
MTL_SHUF(quad_shuffle_down, 3, 4)
MTL_SHUF(quad_shuffle_rotate_up, 4, 4)
MTL_SHUF(quad_shuffle_rotate_down, 5, 4)
#undef MTL_SHUF
template <class T, bool Down>
MTL_INLINE T __shuffle_fill(T data, T filling, uint delta, uint modulo, const __mtl::Site& s) {
  T out;
  MtlCollRec r;
  r.fn = &__mtl::op_fill<T, Down>;
  r.in = &data;
  r.in2 = &filling;
  r.in3 = nullptr;
  r.out = &out;
  r.arg = (uint64_t)(delta & 0xFFFF) | ((uint64_t)modulo << 16);
  r.file = s.file;
  r.line = s.line;
  r.col = s.col;
  r.kind = MTL_C_SIMD;
  __mtl_rt_collective(&r);
  return out;
}
template <class T> MTL_INLINE T simd_shuffle_and_fill_down(T data, T filling, ushort delta, __mtl::Site s = {}) {
  return __shuffle_fill<T, true>(data, filling, delta, 32, s);
}
template <class T> MTL_INLINE T simd_shuffle_and_fill_down(T data, T filling, ushort delta, ushort modulo, __mtl::Site s = {}) {
  return __shuffle_fill<T, true>(data, filling, delta, modulo, s);
}
template <class T> MTL_INLINE T simd_shuffle_and_fill_up(T data, T filling, ushort delta, __mtl::Site s = {}) {
  return __shuffle_fill<T, false>(data, filling, delta, 32, s);
}
template <class T> MTL_INLINE T simd_shuffle_and_fill_up(T data, T filling, ushort delta, ushort modulo, __mtl::Site s = {}) {
  return __shuffle_fill<T, false>(data, filling, delta, modulo, s);
}
template <class T> MTL_INLINE T simd_broadcast_first(T x, __mtl::Site s = {}) { return __mtl::collective<T>(&__mtl::op_shuffle<T, 6, 32>, x, 0, s); }
template <class T> MTL_INLINE T quad_sum(T x, __mtl::Site s = {}) { return __mtl::collective<T>(&__mtl::op_quad_reduce<T, 0>, x, 0, s); }
template <class T> MTL_INLINE T quad_product(T x, __mtl::Site s = {}) { return __mtl::collective<T>(&__mtl::op_quad_reduce<T, 1>, x, 0, s); }
template <class T> MTL_INLINE T quad_max(T x, __mtl::Site s = {}) { return __mtl::collective<T>(&__mtl::op_quad_reduce<T, 2>, x, 0, s); }
template <class T> MTL_INLINE T quad_min(T x, __mtl::Site s = {}) { return __mtl::collective<T>(&__mtl::op_quad_reduce<T, 3>, x, 0, s); }

struct simd_vote {
  typedef ulong vote_t;
  vote_t v;
  constexpr explicit simd_vote(vote_t x = 0) : v(x) {}
  constexpr explicit operator vote_t() const { return v; }
  constexpr bool all() const { return v == 0xFFFFFFFFul; }
  constexpr bool any() const { return v != 0; }
};
MTL_INLINE simd_vote simd_ballot(bool p, __mtl::Site s = {}) { return simd_vote(__mtl::collective<ulong>(&__mtl::op_vote<0>, p, 0, s)); }
MTL_INLINE bool simd_all(bool p, __mtl::Site s = {}) { return __mtl::collective<ulong>(&__mtl::op_vote<1>, p, 0, s) != 0; }
MTL_INLINE bool simd_any(bool p, __mtl::Site s = {}) { return __mtl::collective<ulong>(&__mtl::op_vote<2>, p, 0, s) != 0; }
MTL_INLINE bool simd_is_first(__mtl::Site s = {}) { return __mtl::collective<ulong>(&__mtl::op_vote<3>, true, 0, s) != 0; }
MTL_INLINE simd_vote simd_active_threads_mask(__mtl::Site s = {}) { return simd_vote(__mtl::collective<ulong>(&__mtl::op_vote<4>, true, 0, s)); }

// ---------------------------------------------------------------- atomics
enum memory_order { memory_order_relaxed = 0, memory_order_acquire, memory_order_release, memory_order_acq_rel, memory_order_seq_cst };
enum thread_scope { thread_scope_thread = 0, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
template <class T> struct atomic { T __v; };
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;

#define MTL_ATOMIC_RMW(name, op)                                                                          \
  template <class T, class U>                                                                            \
  MTL_INLINE T name(volatile atomic<T>* o, U v, memory_order = memory_order_relaxed, thread_scope = thread_scope_device) { \
    T val = (T)v, old;                                                                                   \
    __mtl_rt_atomic((void*)&o->__v, op, __mtl::atomic_type<T>, &val, nullptr, &old);                    \
    return old;                                                                                          \
  }
MTL_ATOMIC_RMW(atomic_exchange_explicit, 2)
MTL_ATOMIC_RMW(atomic_fetch_add_explicit, 3)
MTL_ATOMIC_RMW(atomic_fetch_sub_explicit, 4)
MTL_ATOMIC_RMW(atomic_fetch_min_explicit, 5)
MTL_ATOMIC_RMW(atomic_fetch_max_explicit, 6)
MTL_ATOMIC_RMW(atomic_fetch_and_explicit, 7)
MTL_ATOMIC_RMW(atomic_fetch_or_explicit, 8)
MTL_ATOMIC_RMW(atomic_fetch_xor_explicit, 9)
#undef MTL_ATOMIC_RMW
template <class T>
MTL_INLINE T atomic_load_explicit(const volatile atomic<T>* o, memory_order = memory_order_relaxed, thread_scope = thread_scope_device) {
  T val{}, old;
  __mtl_rt_atomic((void*)&o->__v, 0, __mtl::atomic_type<T>, &val, nullptr, &old);
  return old;
}
template <class T, class U>
MTL_INLINE void atomic_store_explicit(volatile atomic<T>* o, U v, memory_order = memory_order_relaxed, thread_scope = thread_scope_device) {
  T val = (T)v, old;
  __mtl_rt_atomic((void*)&o->__v, 1, __mtl::atomic_type<T>, &val, nullptr, &old);
}
template <class T, class U>
MTL_INLINE bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* o, T* expected, U desired, memory_order = memory_order_relaxed,
                                                      memory_order = memory_order_relaxed, thread_scope = thread_scope_device) {
  T val = (T)desired, old;
  return __mtl_rt_atomic((void*)&o->__v, 10, __mtl::atomic_type<T>, &val, expected, &old) != 0;
}
template <class T, class U>
MTL_INLINE bool atomic_compare_exchange_strong_explicit(volatile atomic<T>* o, T* expected, U desired, memory_order a = memory_order_relaxed,
                                                        memory_order b = memory_order_relaxed, thread_scope c = thread_scope_device) {
  return atomic_compare_exchange_weak_explicit(o, expected, desired, a, b, c);
}

}  // namespace metal

#include "mtl_math.h"
#include "mtl_simdgroup_matrix.h"
#include "mtl_kernel.h"

using namespace metal;
// MSL types are visible without `metal::`.
using metal::half;
using metal::bfloat;
using metal::uint;
using metal::uchar;
using metal::ushort;
using metal::ulong;

#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#define M_E_H ((half)M_E_F)
#define M_LOG2E_H ((half)M_LOG2E_F)
#define M_LN2_H ((half)M_LN2_F)
#define M_PI_H ((half)M_PI_F)
#define M_SQRT2_H ((half)M_SQRT2_F)
#define MAXFLOAT 3.40282347e+38f
#define FLT_MAX 3.40282347e+38f
#define FLT_MIN 1.17549435e-38f
#define FLT_EPSILON 1.1920929e-07f
#define HUGE_VALF __builtin_huge_valf()
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define MAXHALF ((half)65504.0f)
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)6.103515625e-05f)
#define HALF_EPSILON ((half)0.0009765625f)
#define HUGE_VALH ((half)__builtin_inff())
#define INT_MAX 2147483647
#define INT_MIN (-2147483647 - 1)
#define UINT_MAX 4294967295u
#define SHRT_MAX 32767
#define USHRT_MAX 65535
#define CHAR_BIT 8
