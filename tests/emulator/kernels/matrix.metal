// simdgroup_matrix: load/store with stride, origin and transpose, multiply(-accumulate),
// make_filled, diagonal constructor and thread_elements() layout.
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;

template <typename T, typename Acc>
kernel void gemm(device const T* A [[buffer(0)]], device const T* B [[buffer(1)]], device Acc* C [[buffer(2)]],
                 constant uint& M [[buffer(3)]], constant uint& N [[buffer(4)]], constant uint& K [[buffer(5)]],
                 constant uint& flags [[buffer(6)]], uint2 tg [[threadgroup_position_in_grid]],
                 uint sg [[simdgroup_index_in_threadgroup]]) {
  // one 8x8 output tile per simdgroup; A is M x K (or K x M when flags & 1), B is K x N (or N x K when flags & 2)
  const bool ta = flags & 1, tb = flags & 2;
  uint row0 = tg.y * 16 + (sg / 2) * 8, col0 = tg.x * 16 + (sg % 2) * 8;
  simdgroup_matrix<Acc, 8, 8> acc = make_filled_simdgroup_matrix<Acc, 8, 8>(Acc(0));
  for (uint k = 0; k < K; k += 8) {
    simdgroup_matrix<T, 8, 8> a, b;
    if (ta) simdgroup_load(a, A, M, ulong2(row0, k), true);
    else simdgroup_load(a, A, K, ulong2(k, row0));
    if (tb) simdgroup_load(b, B, K, ulong2(k, col0), true);
    else simdgroup_load(b, B, N, ulong2(col0, k));
    simdgroup_multiply_accumulate(acc, a, b, acc);
  }
  simdgroup_store(acc, C, N, ulong2(col0, row0));
}

#define instantiate_gemm(tname, T, Acc) \
  template [[host_name("gemm_" #tname "_" #Acc)]] [[kernel]] decltype(gemm<T, Acc>) gemm<T, Acc>;
instantiate_gemm(float, float, float)
instantiate_gemm(half, half, float)
instantiate_gemm(half, half, half)
instantiate_gemm(bfloat, bfloat, float)

// Lane -> element layout: every lane writes which (row, col) it owns.
kernel void layout(device float* out [[buffer(0)]], device float* diag [[buffer(1)]],
                   device float* prod [[buffer(2)]], device float* st_t [[buffer(3)]],
                   ushort lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m;
  m.thread_elements()[0] = float(lane * 2);
  m.thread_elements()[1] = float(lane * 2 + 1);
  simdgroup_store(m, out, 8);
  simdgroup_float8x8 d = simdgroup_float8x8(3.0f);
  simdgroup_store(d, diag, 8);
  simdgroup_float8x8 p;
  simdgroup_multiply(p, d, m);  // 3 * m
  simdgroup_store(p, prod, 8);
  simdgroup_store(m, st_t, 8, ulong2(0, 0), true);
}
