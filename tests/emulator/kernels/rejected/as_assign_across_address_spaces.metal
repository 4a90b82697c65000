// expect: address-space
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* a [[buffer(0)]], constant float* b [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  device float* p = a;
  p = b;  // error
  p[i] = 0.0f;
}
