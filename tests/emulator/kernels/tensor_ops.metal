// Metal 4 tensor ops (mpp::tensor_ops::matmul2d on one simdgroup), compiled with
// language_version="4.0".  The kernels know nothing of the element-to-lane
// layout: the test hands each lane the memory offsets of its elements (the
// documented layout, computed in Python), so a wrong layout in the emulator
// gives a wrong product.
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

template <typename TA, typename TB, typename TD, int M, int N, int K, bool TL, bool TR, bool ACC>
kernel void matmul(const device TA* a [[buffer(0)]], const device TB* b [[buffer(1)]], device TD* d [[buffer(2)]],
                   const device ushort* offsets [[buffer(3)]],  // per lane: left, right, destination elements
                   uint lane [[thread_index_in_simdgroup]]) {
  constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(
      M, N, K, TL, TR, false,
      ACC ? mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate
          : mpp::tensor_ops::matmul2d_descriptor::mode::multiply);
  mpp::tensor_ops::matmul2d<desc, metal::execution_simdgroup> op;
  auto ct_a = op.template get_left_input_cooperative_tensor<TA, TB, TD>();
  auto ct_b = op.template get_right_input_cooperative_tensor<TA, TB, TD>();
  auto ct_d = op.template get_destination_cooperative_tensor<metal::remove_addrspace_t<decltype(ct_a)>,
                                                             metal::remove_addrspace_t<decltype(ct_b)>, TD>();
  constexpr int ca = M * K / 32, cb = K * N / 32, cd = M * N / 32;
  static_assert(decltype(ct_a)::get_capacity() == ca && decltype(ct_d)::get_capacity() == cd, "capacity");
  const device ushort* off = offsets + lane * (ca + cb + cd);
  for (int i = 0; i < ct_a.get_capacity(); i++) ct_a[i] = a[off[i]];
  for (int i = 0; i < ct_b.get_capacity(); i++) ct_b[i] = b[off[ca + i]];
  if (ACC)
    for (int i = 0; i < cd; i++) ct_d[i] = d[off[ca + cb + i]];
  op.run(ct_a, ct_b, ct_d);
  for (int i = 0; i < cd; i++) d[off[ca + cb + i]] = ct_d[i];
}

#define MATMUL(ta, tb, td, m, n, k, tl, tr, acc)                                                          \
  template [[host_name("mm_" #ta "_" #tb "_" #td "_" #m "x" #n "x" #k "_" #tl "_" #tr "_" #acc)]] kernel void \
  matmul<ta, tb, td, m, n, k, tl, tr, acc>(const device ta*, const device tb*, device td*, const device ushort*, uint);

// every transpose and mode at MLX's shape (16, 32, 16)
#define FORMS(ta, tb, td, m, n, k)                                                       \
  MATMUL(ta, tb, td, m, n, k, false, false, false) MATMUL(ta, tb, td, m, n, k, true, false, false) \
  MATMUL(ta, tb, td, m, n, k, false, true, false) MATMUL(ta, tb, td, m, n, k, true, true, false)   \
  MATMUL(ta, tb, td, m, n, k, false, false, true) MATMUL(ta, tb, td, m, n, k, true, false, true)   \
  MATMUL(ta, tb, td, m, n, k, false, true, true) MATMUL(ta, tb, td, m, n, k, true, true, true)
FORMS(half, half, float, 16, 32, 16)
FORMS(float, float, float, 16, 32, 16)
FORMS(bfloat, bfloat, float, 16, 32, 16)
// other shapes: two fragments along k, along m, a 2 x 2 fragment grid
FORMS(half, half, float, 16, 16, 32)
FORMS(float, float, float, 32, 16, 16)
FORMS(float, float, float, 32, 32, 32)
// P @ V of attention (float left, half / bfloat right), and narrow destinations
MATMUL(float, half, float, 16, 32, 16, false, false, true)
MATMUL(float, bfloat, float, 16, 32, 16, false, false, true)
MATMUL(half, half, half, 16, 32, 16, false, true, true)
MATMUL(bfloat, bfloat, bfloat, 16, 32, 16, false, true, true)
MATMUL(half, half, float, 16, 16, 16, false, false, false)

// Index `i` of a left operand (capacity 8): past the end is an out-of-bounds access.
kernel void element_out_of_range(device float* out [[buffer(0)]], constant int& i [[buffer(1)]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(16, 32, 16);
  mpp::tensor_ops::matmul2d<desc, metal::execution_simdgroup> op;
  auto ct_a = op.template get_left_input_cooperative_tensor<half, half, float>();
  ct_a[i] = half(1);
  out[lane] = float(ct_a[0]);
}

// run() by half of the simdgroup
kernel void divergent_run(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(16, 16, 16);
  mpp::tensor_ops::matmul2d<desc, metal::execution_simdgroup> op;
  auto ct_a = op.template get_left_input_cooperative_tensor<float, float, float>();
  auto ct_b = op.template get_right_input_cooperative_tensor<float, float, float>();
  auto ct_d = op.template get_destination_cooperative_tensor<decltype(ct_a), decltype(ct_b), float>();
  for (int i = 0; i < 8; i++) ct_a[i] = ct_b[i] = 1.0f;
  if (lane < 16) op.run(ct_a, ct_b, ct_d);
  out[lane] = ct_d[0];
}
