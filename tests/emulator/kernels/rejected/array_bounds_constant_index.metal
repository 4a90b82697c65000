// expect: array-bounds
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  acc[4] = out[i];  // error
  out[i] = acc[0];
}
