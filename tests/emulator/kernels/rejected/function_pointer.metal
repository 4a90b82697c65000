// expect: function-pointers
#include <metal_stdlib>
using namespace metal;

static float twice(float x) { return 2.0f * x; }
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float (*f)(float) = twice;  // error
  out[i] = f(out[i]);
}
