// Barriers, simd / quad collectives and atomics (<metal_compute>,
// <metal_simdgroup>, <metal_quadgroup>, <metal_atomic>).  Collectives are
// rendezvous in the runtime: a lane waits until the other active lanes of its
// simdgroup reach the same call site.
#pragma once
#pragma clang system_header

namespace metal {

// ---------------------------------------------------------------- barriers
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                       mem_threadgroup_imageblock = 8, mem_object_data = 16 };
MTL_INLINE constexpr mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((int)a | (int)b); }
MTL_INLINE constexpr mem_flags operator&(mem_flags a, mem_flags b) { return (mem_flags)((int)a & (int)b); }
MTL_INLINE constexpr mem_flags operator^(mem_flags a, mem_flags b) { return (mem_flags)((int)a ^ (int)b); }
MTL_INLINE constexpr mem_flags operator~(mem_flags a) { return (mem_flags)(~(int)a & 31); }

MTL_INLINE void threadgroup_barrier(mem_flags = mem_flags::mem_none, __mtl::Site s = {}) {
  __mtl::collective<void>(char(0), 0, s, MTL_C_TG_BARRIER);
}
MTL_INLINE void simdgroup_barrier(mem_flags = mem_flags::mem_none, __mtl::Site s = {}) {
  __mtl::collective<void>(char(0), 0, s, MTL_C_SIMD_BARRIER);
}

// ---------------------------------------------------------------- simd collectives
#define MTL_REDUCE(name, op)                                                               \
  template <typename T> MTL_INLINE T name(T data, __mtl::Site s = {}) {                    \
    return __mtl::collective<__mtl::Reduce<op>>(data, 0, s);                               \
  }
MTL_REDUCE(simd_sum, 0)
MTL_REDUCE(simd_product, 1)
MTL_REDUCE(simd_max, 2)
MTL_REDUCE(simd_min, 3)
MTL_REDUCE(simd_and, 4)
MTL_REDUCE(simd_or, 5)
MTL_REDUCE(simd_xor, 6)
#undef MTL_REDUCE

template <typename T> MTL_INLINE T simd_prefix_inclusive_sum(T data, __mtl::Site s = {}) {
  return __mtl::collective<__mtl::Prefix<0, true>>(data, 0, s);
}
template <typename T> MTL_INLINE T simd_prefix_exclusive_sum(T data, __mtl::Site s = {}) {
  return __mtl::collective<__mtl::Prefix<0, false>>(data, 0, s);
}
template <typename T> MTL_INLINE T simd_prefix_inclusive_product(T data, __mtl::Site s = {}) {
  return __mtl::collective<__mtl::Prefix<1, true>>(data, 0, s);
}
template <typename T> MTL_INLINE T simd_prefix_exclusive_product(T data, __mtl::Site s = {}) {
  return __mtl::collective<__mtl::Prefix<1, false>>(data, 0, s);
}

#define MTL_SHUFFLE(name, mode, width)                                                     \
  template <typename T> MTL_INLINE T name(T data, ushort arg, __mtl::Site s = {}) {       \
    return __mtl::collective<__mtl::Shuffle<mode, width>>(data, arg, s);                   \
  }
MTL_SHUFFLE(simd_shuffle, 0, 32)
MTL_SHUFFLE(simd_broadcast, 0, 32)
MTL_SHUFFLE(simd_shuffle_xor, 1, 32)
MTL_SHUFFLE(simd_shuffle_up, 2, 32)
MTL_SHUFFLE(simd_shuffle_down, 3, 32)
MTL_SHUFFLE(simd_shuffle_rotate_up, 4, 32)
MTL_SHUFFLE(simd_shuffle_rotate_down, 5, 32)
MTL_SHUFFLE(quad_shuffle, 0, 4)
MTL_SHUFFLE(quad_broadcast, 0, 4)
MTL_SHUFFLE(quad_shuffle_xor, 1, 4)
MTL_SHUFFLE(quad_shuffle_up, 2, 4)
MTL_SHUFFLE(quad_shuffle_down, 3, 4)
MTL_SHUFFLE(quad_shuffle_rotate_up, 4, 4)
MTL_SHUFFLE(quad_shuffle_rotate_down, 5, 4)
#undef MTL_SHUFFLE

template <typename T> MTL_INLINE T simd_broadcast_first(T data, __mtl::Site s = {}) {
  return __mtl::collective<__mtl::Shuffle<6, 32>>(data, 0, s);
}
template <typename T> MTL_INLINE T simd_shuffle_and_fill_down(T data, T filling, ushort delta, __mtl::Site s = {}) {
  return __mtl::collective<__mtl::Fill<true>>(data, uint64_t(delta) | (32ul << 16), s, MTL_C_SIMD, &filling);
}
template <typename T> MTL_INLINE T simd_shuffle_and_fill_down(T data, T filling, ushort delta, ushort modulo,
                                                              __mtl::Site s = {}) {
  return __mtl::collective<__mtl::Fill<true>>(data, uint64_t(delta) | (uint64_t(modulo) << 16), s, MTL_C_SIMD,
                                              &filling);
}
template <typename T> MTL_INLINE T simd_shuffle_and_fill_up(T data, T filling, ushort delta, __mtl::Site s = {}) {
  return __mtl::collective<__mtl::Fill<false>>(data, uint64_t(delta) | (32ul << 16), s, MTL_C_SIMD, &filling);
}
template <typename T> MTL_INLINE T simd_shuffle_and_fill_up(T data, T filling, ushort delta, ushort modulo,
                                                            __mtl::Site s = {}) {
  return __mtl::collective<__mtl::Fill<false>>(data, uint64_t(delta) | (uint64_t(modulo) << 16), s, MTL_C_SIMD,
                                               &filling);
}
template <typename T> MTL_INLINE T quad_sum(T data, __mtl::Site s = {}) { return __mtl::collective<__mtl::QuadReduce<0>>(data, 0, s); }
template <typename T> MTL_INLINE T quad_product(T data, __mtl::Site s = {}) { return __mtl::collective<__mtl::QuadReduce<1>>(data, 0, s); }
template <typename T> MTL_INLINE T quad_max(T data, __mtl::Site s = {}) { return __mtl::collective<__mtl::QuadReduce<2>>(data, 0, s); }
template <typename T> MTL_INLINE T quad_min(T data, __mtl::Site s = {}) { return __mtl::collective<__mtl::QuadReduce<3>>(data, 0, s); }

struct simd_vote {
  typedef ulong vote_t;
  vote_t v;
  constexpr explicit simd_vote(vote_t x = 0) : v(x) {}
  constexpr explicit operator vote_t() const { return v; }
  constexpr bool all() const { return v == 0xFFFFFFFFul; }
  constexpr bool any() const { return v != 0; }
};
MTL_INLINE simd_vote simd_ballot(bool expr, __mtl::Site s = {}) {
  return simd_vote(__mtl::collective<__mtl::Vote<0>>(ulong(expr), 0, s));
}
MTL_INLINE bool simd_all(bool expr, __mtl::Site s = {}) { return __mtl::collective<__mtl::Vote<1>>(ulong(expr), 0, s) != 0; }
MTL_INLINE bool simd_any(bool expr, __mtl::Site s = {}) { return __mtl::collective<__mtl::Vote<2>>(ulong(expr), 0, s) != 0; }
MTL_INLINE bool simd_is_first(__mtl::Site s = {}) { return __mtl::collective<__mtl::Vote<3>>(ulong(1), 0, s) != 0; }
MTL_INLINE simd_vote simd_active_threads_mask(__mtl::Site s = {}) {
  return simd_vote(__mtl::collective<__mtl::Vote<4>>(ulong(1), 0, s));
}

// ---------------------------------------------------------------- atomics
enum memory_order { memory_order_relaxed = 0, memory_order_acquire, memory_order_release, memory_order_acq_rel,
                    memory_order_seq_cst };
enum thread_scope { thread_scope_thread = 0, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
MTL_INLINE void atomic_thread_fence(mem_flags, memory_order, thread_scope = thread_scope_device) {}

template <typename T> struct atomic { T __v; };
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;
typedef atomic<long> atomic_long;
typedef atomic<ulong> atomic_ulong;

}  // namespace metal

namespace __mtl {
template <class A> struct atomic_value {};
template <class T> struct atomic_value<metal::atomic<T>> { typedef T type; };
// T of a (device / threadgroup, possibly const volatile) atomic<T>
template <class A> using atomic_value_t = typename atomic_value<plain_t<A>>::type;
template <class T> inline constexpr constant int atomic_type =
    __is_same(T, float) ? 2 : (sizeof(T) == 8 ? (__is_signed(T) ? 3 : 4) : (__is_signed(T) ? 0 : 1));
template <class T, class A>
MTL_INLINE T atomic_op(volatile A* o, int op, T val, thread T* expected = nullptr, thread int* ok = nullptr)
    MTL_IMPL({
      T old;
      int r = __mtl_rt_atomic(raw(&o->__v), op, atomic_type<T>, &val, expected, &old);
      if (ok) *ok = r;
      return old;
    })
}  // namespace __mtl

namespace metal {
#define MTL_ATOMIC_RMW(name, op)                                                                         \
  template <typename A, typename U, typename T = __mtl::atomic_value_t<A>>                              \
  MTL_INLINE T name(volatile A* object, U operand, memory_order = memory_order_relaxed,                 \
                    thread_scope = thread_scope_device) {                                               \
    return __mtl::atomic_op<T>(object, op, T(operand));                                                 \
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
template <typename A, typename T = __mtl::atomic_value_t<A>>
MTL_INLINE T atomic_load_explicit(const volatile A* object, memory_order = memory_order_relaxed,
                                  thread_scope = thread_scope_device) {
  return __mtl::atomic_op<T>(object, 0, T());
}
template <typename A, typename U, typename T = __mtl::atomic_value_t<A>>
MTL_INLINE void atomic_store_explicit(volatile A* object, U desired, memory_order = memory_order_relaxed,
                                      thread_scope = thread_scope_device) {
  __mtl::atomic_op<T>(object, 1, T(desired));
}
template <typename A, typename U, typename T = __mtl::atomic_value_t<A>>
MTL_INLINE bool atomic_compare_exchange_weak_explicit(volatile A* object, thread T* expected, U desired,
                                                      memory_order = memory_order_relaxed,
                                                      memory_order = memory_order_relaxed,
                                                      thread_scope = thread_scope_device) {
  int ok = 0;
  __mtl::atomic_op<T>(object, 10, T(desired), expected, &ok);
  return ok != 0;
}
template <typename A, typename U, typename T = __mtl::atomic_value_t<A>>
MTL_INLINE bool atomic_compare_exchange_strong_explicit(volatile A* object, thread T* expected, U desired,
                                                        memory_order a = memory_order_relaxed,
                                                        memory_order b = memory_order_relaxed,
                                                        thread_scope c = thread_scope_device) {
  return atomic_compare_exchange_weak_explicit(object, expected, desired, a, b, c);
}
}  // namespace metal
