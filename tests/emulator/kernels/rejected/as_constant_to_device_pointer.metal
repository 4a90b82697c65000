// expect: address-space
#include <metal_stdlib>
using namespace metal;

kernel void k(constant float* weights [[buffer(0)]], device float* out [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  device const float* w = weights;  // error
  out[i] = w[i];
}
