// expect: function-pointers
#include <metal_stdlib>
using namespace metal;

static float twice(float x) { return 2.0f * x; }
static float thrice(float x) { return 3.0f * x; }
METAL_FUNC float apply(float (*f)(float), float x) {
  return f(x);  // error
}
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = i % 2 ? apply(twice, out[i]) : apply(thrice, out[i]);
}
