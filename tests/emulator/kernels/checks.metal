// Purpose-broken kernels (each must be caught with the right exception) and
// their fixed twins (which must pass: the checks have no false alarms).
#include <metal_stdlib>
using namespace metal;

// Reverse a tile through threadgroup memory.  BARRIER=false forgets the barrier.
template <bool BARRIER>
kernel void reverse_tile(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                         uint tid [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]],
                         uint gid [[thread_position_in_grid]]) {
  threadgroup float tile[256];
  tile[tid] = x[gid];
  if (BARRIER) threadgroup_barrier(mem_flags::mem_threadgroup);
  y[gid] = tile[n - 1 - tid];
}
template [[host_name("missing_barrier")]] [[kernel]] decltype(reverse_tile<false>) reverse_tile<false>;
template [[host_name("with_barrier")]] [[kernel]] decltype(reverse_tile<true>) reverse_tile<true>;

// Exchange within one simdgroup: ordered by a simd collective, no barrier needed.
kernel void simd_exchange(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                          uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float tile[64];
  tile[tid] = x[tid];
  simdgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = tile[sg * 32 + (31 - lane)];
}

kernel void divergent_barrier(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  if (tid < 40) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[tid] = 1;
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[tid] = 2;
  }
}

// Early exit before a barrier is fine: exited threads do not take part.
kernel void early_exit(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float t[64];
  if (tid >= 40) return;
  t[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = t[39 - tid];
}

kernel void mma_divergent(device float* y [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 a = simdgroup_float8x8(1.0f), c = simdgroup_float8x8(0.0f);
  if (lane < 16) simdgroup_multiply(c, a, a);
  simdgroup_store(c, y, 8);
}

kernel void read_past_end(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
  y[i] = x[i + 1];
}
kernel void write_past_end(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i + 1] = 1.0f;
}
kernel void write_before_start(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[int(i) - 1] = 1.0f;
}
kernel void tg_overflow(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float t[32];
  t[tid] = 1.0f;  // launched with more than 32 threads
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = t[tid];
}

// Every threadgroup writes y[0]: a write-write race between threadgroups.
kernel void cross_tg_race(device float* y [[buffer(0)]], uint tg [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]]) {
  if (tid == 0) y[0] = float(tg);
}
// The same with an atomic: not a race.
kernel void cross_tg_atomic(device atomic_uint* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  if (tid == 0) atomic_fetch_add_explicit(y, 1u, memory_order_relaxed);
}
// Read-modify-write of the same element by two threads of a threadgroup with no barrier.
kernel void rmw_race(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  y[tid / 2] += 1.0f;
}

kernel void too_much_tg(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float a[8192];
  threadgroup float b[16];
  a[tid] = 1;
  b[tid] = 2;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = a[tid] + b[tid];
}

kernel void spin_forever(device float* y [[buffer(0)]]) {
  volatile device float* v = y;  // volatile, so the loop cannot be optimised away
  while (v[0] == 0.0f) {
  }
}

kernel void divide_by_zero(device int* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  y[tid] = 100 / y[tid];
}

kernel void deep_recursion_stack(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  float big[200000];  // 800 KB of thread-private memory: more than a thread's stack
  for (int i = 0; i < 200000; i += 1000) big[i] = y[0] + i;
  y[tid] = big[(tid * 1000) % 200000];
}

// Vector accesses at addresses that are not multiples of the vector's size:
// the GPU needs them aligned (packed_float4 is the unaligned spelling).
kernel void misaligned_device(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                              constant uint& offset [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  device const float4* v = (device const float4*)(x + offset);
  const float4 t = v[i];  // misaligned device load
  y[i] = t.x;
}
kernel void misaligned_threadgroup(device float* y [[buffer(0)]], constant uint& offset [[buffer(1)]],
                                   uint i [[thread_position_in_threadgroup]]) {
  threadgroup float tile[64];
  tile[i] = float(i);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup float2* v = (threadgroup float2*)(tile + offset);
  const float2 t = v[i];  // misaligned threadgroup load
  y[i] = t.y;
}
kernel void packed_device(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                          constant uint& offset [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  device const packed_float4* v = (device const packed_float4*)(x + offset);
  const float4 t = v[i];
  y[i] = t.x;
}

// The lanes of one simdgroup storing at one store site in one step: one SIMD
// store on the GPU.  The same value is no race; different values, or two
// simdgroups storing to one address, are.
kernel void simd_same_value(device float* o [[buffer(0)]], uint sg [[simdgroup_index_in_threadgroup]]) {
  if (sg == 0) o[0] = 1.0f;  // same value from every lane of simdgroup 0
}
kernel void simd_same_value_then_read(device float* o [[buffer(0)]], device float* y [[buffer(1)]],
                                      uint sg [[simdgroup_index_in_threadgroup]],
                                      uint lane [[thread_index_in_simdgroup]]) {
  if (sg == 0) {
    o[0] = 2.0f;
    simdgroup_barrier(mem_flags::mem_device);
    y[lane] = o[0];
  }
}
kernel void simd_different_values(device float* o [[buffer(0)]], uint sg [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  if (sg == 0) o[0] = float(lane);  // lanes disagree: a race
}
kernel void two_simdgroups_same_value(device float* o [[buffer(0)]]) {
  o[0] = 1.0f;  // the same value, but from two simdgroups: a race
}
kernel void threadgroup_same_value(device float* o [[buffer(0)]], uint sg [[simdgroup_index_in_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float t[1];
  if (sg == 1) t[0] = 3.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) o[lane] = t[0];
}

// A buffer argument the kernel never reads needs no binding; one it reads does.
kernel void unread_buffer(device float* y [[buffer(0)]], device const float* unused [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
  y[i] = float(i);
}
kernel void read_buffer(device float* y [[buffer(0)]], device const float* x [[buffer(1)]],
                        uint i [[thread_position_in_grid]]) {
  y[i] = x[i];
}
