// Atomic operations (threadgroup or device memory).  Exempt from race checks,
// bounds-checked and counted like ordinary accesses.
#pragma once

#include "race_detector.h"  // atomics are bounds-checked like every access
#include "state.h"

enum { A_LOAD, A_STORE, A_XCHG, A_ADD, A_SUB, A_MIN, A_MAX, A_AND, A_OR, A_XOR, A_CAS };
enum { AT_I32, AT_U32, AT_F32, AT_I64, AT_U64 };

template <class T>
static int atomic_op(T* p, int op, const void* val, void* cmp, void* out) {
  T v = *(const T*)val;
  T old;
  switch (op) {
    case A_LOAD: old = __atomic_load_n(p, __ATOMIC_RELAXED); break;
    case A_STORE: __atomic_store_n(p, v, __ATOMIC_RELAXED); old = v; break;
    case A_XCHG: old = __atomic_exchange_n(p, v, __ATOMIC_RELAXED); break;
    case A_ADD: old = __atomic_fetch_add(p, v, __ATOMIC_RELAXED); break;
    case A_SUB: old = __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); break;
    case A_AND: old = __atomic_fetch_and(p, v, __ATOMIC_RELAXED); break;
    case A_OR: old = __atomic_fetch_or(p, v, __ATOMIC_RELAXED); break;
    case A_XOR: old = __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); break;
    case A_MIN:
    case A_MAX: {
      old = __atomic_load_n(p, __ATOMIC_RELAXED);
      for (;;) {
        T nv = op == A_MIN ? (v < old ? v : old) : (v > old ? v : old);
        if (__atomic_compare_exchange_n(p, &old, nv, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) break;
      }
      break;
    }
    case A_CAS: {
      T expected = *(T*)cmp;
      bool ok = __atomic_compare_exchange_n(p, &expected, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
      *(T*)cmp = expected;
      old = expected;
      if (out) *(T*)out = old;
      return ok;
    }
    default: return 0;
  }
  if (out) *(T*)out = old;
  return 1;
}

static int atomic_float(uint32_t* p, int op, const void* val, void* cmp, void* out) {
  float v = *(const float*)val;
  if (op == A_LOAD || op == A_STORE || op == A_XCHG || op == A_CAS) return atomic_op<uint32_t>(p, op, val, cmp, out);
  uint32_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
  for (;;) {
    float o;
    memcpy(&o, &old, 4);
    float n = op == A_ADD ? o + v : op == A_SUB ? o - v : op == A_MIN ? (v < o ? v : o) : (v > o ? v : o);
    uint32_t nb;
    memcpy(&nb, &n, 4);
    if (__atomic_compare_exchange_n(p, &old, nb, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) break;
  }
  if (out) memcpy(out, &old, 4);
  return 1;
}

RT_EXPORT int __mtl_rt_atomic(void* addr, int op, int type, const void* val, void* cmp, void* out) {
  Worker* w = tls_w;
  size_t size = (type == AT_I64 || type == AT_U64) ? 8 : 4;
  w->st.atomics++;
  if (w->L && w->L->checked && w->cur) {
    uintptr_t a = (uintptr_t)addr;
    void* pc = __builtin_return_address(0);
    if (a % size) {
      set_error(w, MTL_E_OUT_OF_BOUNDS, (int)w->cur->index, nullptr, 0, "misaligned atomic access at %p", addr);
      w->L->d->err->pc_offset = pc_offset(pc);
      abort_fiber(w);
    }
    if (a - (uintptr_t)w->arena >= kArenaBytes) {
      int region;
      int b = find_bind(w->L, a, size, &region);
      if (b < 0) {
        oob_error(w, a, size, op == A_LOAD ? 0 : 1, pc);
        abort_fiber(w);
      }
      Bind& B = w->L->binds[b];
      if (op != A_STORE) { w->st.device_read += size; w->st.buf_read[B.index] += size; }
      if (op != A_LOAD) { w->st.device_written += size; w->st.buf_written[B.index] += size; }
    }
  }
  switch (type) {
    case AT_I32: return atomic_op<int32_t>((int32_t*)addr, op, val, cmp, out);
    case AT_U32: return atomic_op<uint32_t>((uint32_t*)addr, op, val, cmp, out);
    case AT_F32: return atomic_float((uint32_t*)addr, op, val, cmp, out);
    case AT_I64: return atomic_op<int64_t>((int64_t*)addr, op, val, cmp, out);
    default: return atomic_op<uint64_t>((uint64_t*)addr, op, val, cmp, out);
  }
}
