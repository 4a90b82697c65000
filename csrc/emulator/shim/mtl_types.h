// Scalar and vector types, type traits, numeric limits, array, as_type:
// the parts of <metal_types>, <metal_type_traits>, <metal_limits> and
// <metal_array> that compute kernels use.  As in Apple's headers the types
// are global typedefs also visible as metal::name; everything else the shim
// needs lives in namespace __mtl, so namespace metal declares only what
// Apple's metal_stdlib declares.
#pragma once
#pragma clang system_header

// ---------------------------------------------------------------- scalars
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long int64_t;
typedef unsigned long uint64_t;
typedef __SIZE_TYPE__ size_t;
typedef __PTRDIFF_TYPE__ ptrdiff_t;
typedef __INTPTR_TYPE__ intptr_t;
typedef __UINTPTR_TYPE__ uintptr_t;
typedef __bf16 bfloat;

namespace __mtl {
template <class T, int N> using ev = T __attribute__((ext_vector_type(N)));  // before metal::vec exists
}

// ---------------------------------------------------------------- vectors
// boolN are vectors of one-byte 0/1 elements (sizeof(bool4) == 4 as on the
// GPU); clang's bool vectors are bit-packed and not valid in OpenCL mode.
#define MTL_VECTORS(T, name)                                                               \
  typedef T name##2 __attribute__((ext_vector_type(2)));                                   \
  typedef T name##3 __attribute__((ext_vector_type(3)));                                   \
  typedef T name##4 __attribute__((ext_vector_type(4)));                                   \
  typedef T packed_##name##2 __attribute__((ext_vector_type(2), aligned(sizeof(T))));      \
  typedef T packed_##name##4 __attribute__((ext_vector_type(4), aligned(sizeof(T))));
MTL_VECTORS(signed char, bool)
MTL_VECTORS(char, char)
MTL_VECTORS(uchar, uchar)
MTL_VECTORS(short, short)
MTL_VECTORS(ushort, ushort)
MTL_VECTORS(int, int)
MTL_VECTORS(uint, uint)
MTL_VECTORS(long, long)
MTL_VECTORS(ulong, ulong)
MTL_VECTORS(half, half)
MTL_VECTORS(bfloat, bfloat)
MTL_VECTORS(float, float)
#undef MTL_VECTORS

namespace __mtl {
// packed 3-vectors are 3 elements in memory (ext vectors of 3 take 4 slots).
// Member functions exist for every address space, like Apple's built-in type.
template <class T>
struct packed_vec3 {
  T x, y, z;
#define MTL_PACKED3_AS(AS)                                                          \
  MTL_INLINE operator ev<T, 3>() const AS { return ev<T, 3>{x, y, z}; }            \
  MTL_INLINE const AS T& operator[](int i) const AS { return (&x)[i]; }
  MTL_EACH_ADDRESS_SPACE(MTL_PACKED3_AS)
#define MTL_PACKED3_MUT(AS) MTL_INLINE AS T& operator[](int i) AS { return (&x)[i]; }
  MTL_EACH_WRITABLE_ADDRESS_SPACE(MTL_PACKED3_MUT)
#undef MTL_PACKED3_AS
#undef MTL_PACKED3_MUT
  MTL_INLINE packed_vec3& operator=(ev<T, 3> v) {
    x = v.x, y = v.y, z = v.z;
    return *this;
  }
};
template <class T>
MTL_INLINE packed_vec3<T> make_packed3(ev<T, 3> v) {
  packed_vec3<T> p;
  p.x = v.x, p.y = v.y, p.z = v.z;
  return p;
}
}  // namespace __mtl
typedef __mtl::packed_vec3<signed char> packed_bool3;
// A bool lane: what `bool` template type arguments become in a source that
// forms vec<bool, N> (prepass.bool_type_arguments): a distinct one-byte type
// that can be a vector element (bool cannot, in C++ for OpenCL; an enum over
// bool would make the vector one of i1).  The shim's conversions to it give
// 0 or 1 (__mtl::conv).
enum __mtl_bool_lane : signed char {};
typedef __mtl::packed_vec3<char> packed_char3;
typedef __mtl::packed_vec3<uchar> packed_uchar3;
typedef __mtl::packed_vec3<short> packed_short3;
typedef __mtl::packed_vec3<ushort> packed_ushort3;
typedef __mtl::packed_vec3<int> packed_int3;
typedef __mtl::packed_vec3<uint> packed_uint3;
typedef __mtl::packed_vec3<half> packed_half3;
typedef __mtl::packed_vec3<bfloat> packed_bfloat3;
typedef __mtl::packed_vec3<float> packed_float3;

namespace metal {
using ::uchar;
using ::ushort;
using ::uint;
using ::ulong;
using ::int8_t;
using ::uint8_t;
using ::int16_t;
using ::uint16_t;
using ::int32_t;
using ::uint32_t;
using ::int64_t;
using ::uint64_t;
using ::size_t;
using ::ptrdiff_t;
using ::intptr_t;
using ::uintptr_t;
#define MTL_VECTOR_NAMES(name)                                                              \
  using ::name##2;                                                                         \
  using ::name##3;                                                                         \
  using ::name##4;                                                                         \
  using ::packed_##name##2;                                                                \
  using ::packed_##name##3;                                                                \
  using ::packed_##name##4;
MTL_VECTOR_NAMES(bool)
MTL_VECTOR_NAMES(char)
MTL_VECTOR_NAMES(uchar)
MTL_VECTOR_NAMES(short)
MTL_VECTOR_NAMES(ushort)
MTL_VECTOR_NAMES(int)
MTL_VECTOR_NAMES(uint)
MTL_VECTOR_NAMES(half)
MTL_VECTOR_NAMES(bfloat)
MTL_VECTOR_NAMES(float)
#undef MTL_VECTOR_NAMES
using ::long2;
using ::long3;
using ::long4;
using ::ulong2;
using ::ulong3;
using ::ulong4;

// vec<T, N> deduces T and N like Apple's. boolN are one-byte-per-lane
// vectors: C++ for OpenCL has no bool element type, so a source that forms
// vec<bool, N> is compiled with its bool template arguments spelled __mtl_bool_lane
// (compiler.check_rules retries so; docs/emulator.md).
template <typename T, int N>
using vec = T __attribute__((ext_vector_type(N)));
template <typename T, int N>
using packed_vec = T __attribute__((ext_vector_type(N), aligned(sizeof(T))));

// ---------------------------------------------------------------- type traits (<metal_type_traits>)
template <bool B, typename T = void> struct enable_if {};
template <typename T> struct enable_if<true, T> { typedef T type; };
template <bool B, typename T = void> using enable_if_t = typename enable_if<B, T>::type;

template <bool B, typename T, typename F> struct conditional { typedef T type; };
template <typename T, typename F> struct conditional<false, T, F> { typedef F type; };
template <bool B, typename T, typename F> using conditional_t = typename conditional<B, T, F>::type;

template <typename T> struct remove_volatile { typedef T type; };
template <typename T> struct remove_volatile<volatile T> { typedef T type; };
template <typename T> using remove_volatile_t = typename remove_volatile<T>::type;
template <typename T> struct remove_const { typedef T type; };
template <typename T> struct remove_const<const T> { typedef T type; };
template <typename T> using remove_const_t = typename remove_const<T>::type;
template <typename T> struct remove_cv { typedef remove_volatile_t<remove_const_t<T>> type; };
template <typename T> using remove_cv_t = typename remove_cv<T>::type;
template <typename T> struct add_const { typedef const T type; };
template <typename T> using add_const_t = typename add_const<T>::type;
template <typename T> struct add_volatile { typedef volatile T type; };
template <typename T> using add_volatile_t = typename add_volatile<T>::type;
template <typename T> struct add_cv { typedef const volatile T type; };
template <typename T> using add_cv_t = typename add_cv<T>::type;
template <typename T> struct remove_reference { typedef T type; };
template <typename T> struct remove_reference<T&> { typedef T type; };
template <typename T> struct remove_reference<T&&> { typedef T type; };
template <typename T> using remove_reference_t = typename remove_reference<T>::type;
template <typename T> struct remove_pointer { typedef T type; };
template <typename T> struct remove_pointer<T*> { typedef T type; };
template <typename T> struct remove_pointer<T* const> { typedef T type; };
template <typename T> struct remove_pointer<T* volatile> { typedef T type; };
template <typename T> struct remove_pointer<T* const volatile> { typedef T type; };
template <typename T> using remove_pointer_t = typename remove_pointer<T>::type;
// remove_addrspace<device const float> is const float
template <typename T> struct remove_addrspace { typedef T type; };
template <typename T> struct remove_addrspace<__global T> { typedef T type; };
template <typename T> struct remove_addrspace<__local T> { typedef T type; };
template <typename T> struct remove_addrspace<__constant T> { typedef T type; };
template <typename T> struct remove_addrspace<__private T> { typedef T type; };
#ifndef __MTL_RULES_THIS__  // a type deduced through a generic reference (thread T& in a function type)
template <typename T> struct remove_addrspace<__generic T> { typedef T type; };
#endif
template <typename T> using remove_addrspace_t = typename remove_addrspace<T>::type;

template <typename T, T v>
struct integral_constant {
  typedef T value_type;
  typedef integral_constant type;
  static constant constexpr T value = v;
  constexpr operator value_type() const { return value; }
  constexpr value_type operator()() const { return value; }
};
template <bool B> using bool_constant = integral_constant<bool, B>;
using true_type = bool_constant<true>;
using false_type = bool_constant<false>;

template <typename U, typename V> struct is_same : bool_constant<__is_same(U, V)> {};
template <typename U, typename V> constexpr constant bool is_same_v = is_same<U, V>::value;

// Traits on vectors answer for the element type, as Apple's do.
template <typename T> struct is_integral : bool_constant<__is_integral(remove_cv_t<T>)> {};
template <typename T, int N> struct is_integral<T __attribute__((ext_vector_type(N)))> : is_integral<T> {};
template <typename T> constexpr constant bool is_integral_v = is_integral<T>::value;
template <typename T> struct is_floating_point : bool_constant<__is_floating_point(remove_cv_t<T>)> {};
template <typename T, int N> struct is_floating_point<T __attribute__((ext_vector_type(N)))> : is_floating_point<T> {};
template <typename T> constexpr constant bool is_floating_point_v = is_floating_point<T>::value;
template <typename T> struct is_arithmetic : bool_constant<__is_arithmetic(remove_cv_t<T>)> {};
template <typename T, int N> struct is_arithmetic<T __attribute__((ext_vector_type(N)))> : is_arithmetic<T> {};
template <typename T> constexpr constant bool is_arithmetic_v = is_arithmetic<T>::value;
template <typename T> struct is_scalar : bool_constant<__is_scalar(remove_cv_t<T>)> {};
template <typename T> constexpr constant bool is_scalar_v = is_scalar<T>::value;
template <typename T> struct is_vector : false_type {};
template <typename T, int N> struct is_vector<T __attribute__((ext_vector_type(N)))> : true_type {};
template <typename T> struct is_vector<const T> : is_vector<T> {};
template <typename T> struct is_vector<volatile T> : is_vector<T> {};
template <typename T> struct is_vector<const volatile T> : is_vector<T> {};
template <typename T> constexpr constant bool is_vector_v = is_vector<T>::value;
template <typename T> struct is_signed : bool_constant<__is_signed(remove_cv_t<T>)> {};
template <typename T, int N> struct is_signed<T __attribute__((ext_vector_type(N)))> : is_signed<T> {};
template <typename T> constexpr constant bool is_signed_v = is_signed<T>::value;
template <typename T> struct is_unsigned : bool_constant<__is_unsigned(remove_cv_t<T>)> {};
template <typename T, int N> struct is_unsigned<T __attribute__((ext_vector_type(N)))> : is_unsigned<T> {};
template <typename T> constexpr constant bool is_unsigned_v = is_unsigned<T>::value;
// the bool lane (__mtl_bool_lane, see above) answers as bool does
template <> struct is_integral<__mtl_bool_lane> : true_type {};
template <> struct is_arithmetic<__mtl_bool_lane> : true_type {};
template <> struct is_unsigned<__mtl_bool_lane> : true_type {};
template <typename U, typename V> struct is_convertible : bool_constant<__is_convertible_to(U, V)> {};
template <typename U, typename V> constexpr constant bool is_convertible_v = is_convertible<U, V>::value;
template <typename T> struct is_class : bool_constant<__is_class(T)> {};
template <typename T> constexpr constant bool is_class_v = is_class<T>::value;
template <typename T> struct is_enum : bool_constant<__is_enum(T)> {};
template <typename T> constexpr constant bool is_enum_v = is_enum<T>::value;
template <typename T> struct is_const : bool_constant<__is_const(T)> {};
template <typename T> constexpr constant bool is_const_v = is_const<T>::value;

// vec_elements<float4>::value == 4, 0 for scalars (as in Apple's headers)
template <typename T> struct vec_elements : integral_constant<size_t, 0> {};
template <typename T, int N> struct vec_elements<T __attribute__((ext_vector_type(N)))> : integral_constant<size_t, N> {};
template <typename T> struct vec_elements<const T> : vec_elements<T> {};
template <typename T> struct make_scalar { typedef remove_cv_t<T> type; };
template <typename T, int N> struct make_scalar<T __attribute__((ext_vector_type(N)))> { typedef T type; };
template <typename T> struct make_scalar<const T> : make_scalar<T> {};
template <typename T> using make_scalar_t = typename make_scalar<T>::type;

template <typename T> struct make_signed { typedef remove_cv_t<T> type; };
template <> struct make_signed<char> { typedef signed char type; };
template <> struct make_signed<uchar> { typedef signed char type; };
template <> struct make_signed<ushort> { typedef short type; };
template <> struct make_signed<uint> { typedef int type; };
template <> struct make_signed<ulong> { typedef long type; };
template <typename T, int N> struct make_signed<T __attribute__((ext_vector_type(N)))> {
  typedef typename make_signed<T>::type __attribute__((ext_vector_type(N))) type;
};
template <typename T> using make_signed_t = typename make_signed<T>::type;
template <typename T> struct make_unsigned { typedef remove_cv_t<T> type; };
template <> struct make_unsigned<char> { typedef uchar type; };
template <> struct make_unsigned<signed char> { typedef uchar type; };
template <> struct make_unsigned<short> { typedef ushort type; };
template <> struct make_unsigned<int> { typedef uint type; };
template <> struct make_unsigned<long> { typedef ulong type; };
template <typename T, int N> struct make_unsigned<T __attribute__((ext_vector_type(N)))> {
  typedef typename make_unsigned<T>::type __attribute__((ext_vector_type(N))) type;
};
template <typename T> using make_unsigned_t = typename make_unsigned<T>::type;
template <typename T> struct underlying_type { typedef __underlying_type(T) type; };
template <typename T> using underlying_type_t = typename underlying_type<T>::type;

template <typename... T> struct disjunction : false_type {};
template <typename T> struct disjunction<T> : T {};
template <typename T, typename... U> struct disjunction<T, U...> : conditional_t<bool(T::value), T, disjunction<U...>> {};
template <typename... T> constexpr constant bool disjunction_v = disjunction<T...>::value;
template <typename... T> struct conjunction : true_type {};
template <typename T> struct conjunction<T> : T {};
template <typename T, typename... U> struct conjunction<T, U...> : conditional_t<bool(T::value), conjunction<U...>, T> {};
template <typename... T> constexpr constant bool conjunction_v = conjunction<T...>::value;
template <typename T> struct negation : bool_constant<!bool(T::value)> {};
template <typename T> constexpr constant bool negation_v = negation<T>::value;
template <typename T> T&& declval();

// ---------------------------------------------------------------- <metal_utility>
template <typename T, T... I>
struct integer_sequence {
  typedef T value_type;
  static constexpr size_t size() { return sizeof...(I); }
};
template <size_t... I> using index_sequence = integer_sequence<size_t, I...>;
template <typename T, T N> using make_integer_sequence = __make_integer_seq<integer_sequence, T, N>;
template <size_t N> using make_index_sequence = make_integer_sequence<size_t, N>;
template <typename... T> using index_sequence_for = make_index_sequence<sizeof...(T)>;

// ---------------------------------------------------------------- <metal_limits>
enum float_round_style {
  round_indeterminate = -1, round_toward_zero = 0, round_to_nearest = 1, round_toward_infinity = 2,
  round_toward_neg_infinity = 3
};
enum float_denorm_style { denorm_indeterminate = -1, denorm_absent = 0, denorm_present = 1 };

template <typename T>
struct numeric_limits {
  static constexpr constant bool is_specialized = false;
  static constexpr constant bool is_signed = false;
  static constexpr constant bool is_integer = false;
  static constexpr constant bool has_infinity = false;
  static constexpr constant bool has_quiet_NaN = false;
  static constexpr T min() { return T(); }
  static constexpr T max() { return T(); }
  static constexpr T lowest() { return T(); }
  static constexpr T epsilon() { return T(); }
  static constexpr T infinity() { return T(); }
  static constexpr T quiet_NaN() { return T(); }
  static constexpr T denorm_min() { return T(); }
};
#define MTL_INT_LIMITS(T, MN, MX)                                                            \
  template <> struct numeric_limits<T> {                                                    \
    static constexpr constant bool is_specialized = true;                                   \
    static constexpr constant bool is_signed = (T)(-1) < (T)0;                              \
    static constexpr constant bool is_integer = true;                                       \
    static constexpr constant bool is_exact = true;                                         \
    static constexpr constant bool has_infinity = false;                                    \
    static constexpr constant bool has_quiet_NaN = false;                                   \
    static constexpr constant int digits = sizeof(T) * 8 - ((T)(-1) < (T)0);                \
    static constexpr constant int radix = 2;                                                \
    static constexpr T min() { return MN; }                                                 \
    static constexpr T max() { return MX; }                                                 \
    static constexpr T lowest() { return MN; }                                              \
    static constexpr T epsilon() { return 0; }                                              \
    static constexpr T infinity() { return 0; }                                             \
    static constexpr T quiet_NaN() { return 0; }                                            \
    static constexpr T denorm_min() { return 0; }                                           \
  };
MTL_INT_LIMITS(bool, false, true)
MTL_INT_LIMITS(char, (char)-128, (char)127)
MTL_INT_LIMITS(signed char, (signed char)-128, (signed char)127)
MTL_INT_LIMITS(uchar, 0, 255)
MTL_INT_LIMITS(short, (short)-32768, (short)32767)
MTL_INT_LIMITS(ushort, 0, 65535)
MTL_INT_LIMITS(int, (-2147483647 - 1), 2147483647)
MTL_INT_LIMITS(uint, 0u, 4294967295u)
MTL_INT_LIMITS(long, (-9223372036854775807L - 1), 9223372036854775807L)
MTL_INT_LIMITS(ulong, 0ul, 18446744073709551615ul)
#undef MTL_INT_LIMITS
#define MTL_FLOAT_LIMITS(T, U, MIN, MAX, LOWEST, EPS, INF, NAN_, DMIN, DIGITS, MINEXP, MAXEXP) \
  template <> struct numeric_limits<T> {                                                    \
    static constexpr constant bool is_specialized = true;                                   \
    static constexpr constant bool is_signed = true;                                        \
    static constexpr constant bool is_integer = false;                                      \
    static constexpr constant bool is_exact = false;                                        \
    static constexpr constant bool has_infinity = true;                                     \
    static constexpr constant bool has_quiet_NaN = true;                                    \
    static constexpr constant bool is_iec559 = true;                                        \
    static constexpr constant int digits = DIGITS;                                          \
    static constexpr constant int radix = 2;                                                \
    static constexpr constant int min_exponent = MINEXP;                                    \
    static constexpr constant int max_exponent = MAXEXP;                                    \
    static constexpr T min() { return __builtin_bit_cast(T, (U)MIN); }                      \
    static constexpr T max() { return __builtin_bit_cast(T, (U)MAX); }                      \
    static constexpr T lowest() { return __builtin_bit_cast(T, (U)LOWEST); }                \
    static constexpr T epsilon() { return __builtin_bit_cast(T, (U)EPS); }                  \
    static constexpr T infinity() { return __builtin_bit_cast(T, (U)INF); }                 \
    static constexpr T quiet_NaN() { return __builtin_bit_cast(T, (U)NAN_); }               \
    static constexpr T denorm_min() { return __builtin_bit_cast(T, (U)DMIN); }              \
  };
MTL_FLOAT_LIMITS(float, uint, 0x00800000u, 0x7F7FFFFFu, 0xFF7FFFFFu, 0x34000000u, 0x7F800000u, 0x7FC00000u,
                 0x00000001u, 24, -125, 128)
MTL_FLOAT_LIMITS(half, ushort, 0x0400, 0x7BFF, 0xFBFF, 0x1400, 0x7C00, 0x7E00, 0x0001, 11, -13, 16)
MTL_FLOAT_LIMITS(bfloat, ushort, 0x0080, 0x7F7F, 0xFF7F, 0x3C00, 0x7F80, 0x7FC0, 0x0001, 8, -125, 128)
#undef MTL_FLOAT_LIMITS
template <typename T> struct numeric_limits<const T> : numeric_limits<T> {};

// ---------------------------------------------------------------- as_type
template <typename T, typename U>
MTL_INLINE T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: the source and destination types must have the same size");
  return __builtin_bit_cast(T, u);
}

// ---------------------------------------------------------------- <metal_uniform>
// uniform<T>: a value the same in every thread; here it behaves as the T it holds.
template <typename T>
struct uniform {
  T __v;
  uniform() = default;
  constexpr uniform(T v) : __v(v) {}
  constexpr operator T() const { return __v; }
};
template <typename T>
constexpr uniform<T> make_uniform(T v) { return uniform<T>(v); }

// ---------------------------------------------------------------- <metal_array>
template <typename T, size_t N>
struct array {
  T __elems[N ? N : 1];
#define MTL_ARRAY_AS(AS)                                                                    \
  MTL_INLINE constexpr size_t size() const AS { return N; }                                 \
  MTL_INLINE constexpr size_t max_size() const AS { return N; }                             \
  MTL_INLINE constexpr bool empty() const AS { return N == 0; }                             \
  MTL_INLINE constexpr const AS T& operator[](size_t i) const AS { return __elems[i]; }     \
  MTL_INLINE constexpr const AS T& front() const AS { return __elems[0]; }                  \
  MTL_INLINE constexpr const AS T& back() const AS { return __elems[N - (N != 0)]; }        \
  MTL_INLINE constexpr const AS T* data() const AS { return __elems; }
  MTL_EACH_ADDRESS_SPACE(MTL_ARRAY_AS)
#define MTL_ARRAY_MUT(AS)                                                                   \
  MTL_INLINE AS T& operator[](size_t i) AS { return __elems[i]; }                           \
  MTL_INLINE AS T& front() AS { return __elems[0]; }                                        \
  MTL_INLINE AS T& back() AS { return __elems[N - (N != 0)]; }                              \
  MTL_INLINE AS T* data() AS { return __elems; }
  MTL_EACH_WRITABLE_ADDRESS_SPACE(MTL_ARRAY_MUT)
#undef MTL_ARRAY_AS
#undef MTL_ARRAY_MUT
};

}  // namespace metal

// as_type<T>(x) is an operator of the language (MSL 2.19), not a name in namespace metal:
// code in its own namespace calls it without `using namespace metal`.
using metal::as_type;

// ---------------------------------------------------------------- shim internals on types
namespace __mtl {
using namespace ::metal;
// The type without cv-qualifiers and address space.
template <class T> using plain_t = metal::remove_cv_t<metal::remove_addrspace_t<metal::remove_cv_t<T>>>;
template <class T> struct vt { static constexpr constant int n = 1; typedef T elem; };
template <class T, int N> struct vt<T __attribute__((ext_vector_type(N)))> { static constexpr constant int n = N; typedef T elem; };
template <class T> struct vt<packed_vec3<T>> { static constexpr constant int n = 3; typedef T elem; };
// vn<float4> == 4, vn<float> == 1; elem_t<float4> == float
template <class T> inline constexpr constant int vn = vt<plain_t<T>>::n;
template <class T> using elem_t = typename vt<plain_t<T>>::elem;
// vec_of<T, N>: the MSL vector type with N elements of T (bool -> boolN)
template <class T, int N> struct vec_of_ { typedef T __attribute__((ext_vector_type(N))) type; };
template <int N> struct vec_of_<bool, N> { typedef signed char __attribute__((ext_vector_type(N))) type; };
template <class T> struct vec_of_<T, 1> { typedef T type; };
template <> struct vec_of_<bool, 1> { typedef bool type; };
template <class T, int N> using vec_of = typename vec_of_<T, N>::type;
template <class T> inline constexpr constant bool is_float = __is_floating_point(plain_t<T>);
}  // namespace __mtl
