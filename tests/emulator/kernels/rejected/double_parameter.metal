// expect: double
#include <metal_stdlib>
using namespace metal;

static float widen(double x) {  // error
  return float(x);
}
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] = widen(out[i]); }
