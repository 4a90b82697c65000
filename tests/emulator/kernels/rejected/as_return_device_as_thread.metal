// expect: address-space
#include <metal_stdlib>
using namespace metal;

static thread float* slot(device float* base, uint i) {
  return base + i;  // error
}
kernel void k(device float* buf [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  *slot(buf, i) = 2.0f;
}
