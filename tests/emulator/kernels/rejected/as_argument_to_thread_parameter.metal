// expect: address-space
#include <metal_stdlib>
using namespace metal;

static float row_sum(thread const float* x, int n) {
  float s = 0.0f;
  for (int j = 0; j < n; j++) s += x[j];
  return s;
}
kernel void k(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  out[i] = row_sum(x + 8 * i, 8);  // error
}
