// simd / quad collectives, checked against numpy in test_collectives.py.
#include <metal_stdlib>
using namespace metal;

#define NOUT 24

kernel void simd_ops(device const float* x [[buffer(0)]], device const int* xi [[buffer(1)]],
                     device float* out [[buffer(2)]], device int* outi [[buffer(3)]],
                     uint gid [[thread_position_in_grid]], ushort lane [[thread_index_in_simdgroup]]) {
  float v = x[gid];
  int iv = xi[gid];
  device float* o = out + gid * NOUT;
  device int* oi = outi + gid * NOUT;
  o[0] = simd_sum(v);
  o[1] = simd_max(v);
  o[2] = simd_min(v);
  o[3] = simd_product(v);
  o[4] = simd_prefix_inclusive_sum(v);
  o[5] = simd_prefix_exclusive_sum(v);
  o[6] = simd_shuffle(v, ushort((lane * 7) % 32));
  o[7] = simd_shuffle_xor(v, 5);
  o[8] = simd_shuffle_up(v, 3);
  o[9] = simd_shuffle_down(v, 3);
  o[10] = simd_shuffle_rotate_up(v, 3);
  o[11] = simd_shuffle_rotate_down(v, 3);
  o[12] = simd_broadcast(v, 9);
  o[13] = simd_broadcast_first(v);
  o[14] = quad_sum(v);
  o[15] = quad_shuffle_xor(v, 1);
  o[16] = quad_broadcast(v, 2);
  o[17] = quad_max(v);
  float2 v2 = float2(v, 2.0f * v);
  float2 s2 = simd_sum(v2);
  o[18] = s2.y;
  half h = half(v);
  o[19] = float(simd_sum(h));
  o[20] = simd_shuffle_and_fill_down(v, -v, 5);
  o[21] = simd_shuffle_and_fill_up(v, -v, 3, 8);
  oi[0] = simd_sum(iv);
  oi[1] = simd_max(iv);
  oi[2] = simd_and(iv);
  oi[3] = simd_or(iv);
  oi[4] = simd_xor(iv);
  oi[5] = simd_prefix_inclusive_sum(iv);
  oi[6] = int(ulong(simd_ballot(iv > 0)));
  oi[7] = simd_all(iv > -100);
  oi[8] = simd_any(iv > 1000);
  oi[9] = simd_is_first();
  oi[10] = int(ulong(simd_active_threads_mask()));
  oi[11] = int(simd_ballot(iv > 0).any());
}

// Collectives in divergent code: the active set is the lanes at the call site.
kernel void partial_lanes(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                          uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  float v = x[gid];
  float a = -1.0f, b = -1.0f, c = -1.0f, d = -1.0f;
  if (lane < 8) {
    a = simd_sum(v);
    b = simd_prefix_exclusive_sum(v);
  } else if (lane % 2 == 0) {
    a = simd_max(v);
    c = float(int(ulong(simd_active_threads_mask())) & 0xffff);
    d = simd_broadcast_first(v);
  }
  out[gid * 4 + 0] = a;
  out[gid * 4 + 1] = b;
  out[gid * 4 + 2] = c;
  out[gid * 4 + 3] = d;
}

// Reduction across a threadgroup: shuffles, threadgroup memory, barrier.
kernel void block_reduce(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                         constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]],
                         uint tgid [[threadgroup_position_in_grid]]) {
  threadgroup float partial[32];
  float v = gid < n ? x[gid] : 0.0f;
  // (shuffles from lanes past the end of a partial simdgroup are undefined: use simd_sum there)
  v = simd_sum(v);
  if (lane == 0) partial[sg] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float w = lane < nsg ? partial[lane] : 0.0f;
    w = simd_sum(w);
    if (lane == 0) out[tgid] = w;
  }
}

// Divergent loop: lanes that leave the loop early wait for the others and the
// collective after the loop runs with every lane (reconvergence), as on a GPU.
kernel void reconverge(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                       constant uint& n [[buffer(2)]], uint lane [[thread_index_in_simdgroup]]) {
  float acc = 0.0f;
  for (uint i = lane; i < n; i += 32) {
    acc += simd_sum(x[i]);  // the last iteration has only the lanes with i < n
  }
  out[lane] = simd_sum(acc);  // after the loop: all 32 lanes
  out[32 + lane] = float(int(ulong(simd_active_threads_mask()) & 0xffffffff) == -1);
}
