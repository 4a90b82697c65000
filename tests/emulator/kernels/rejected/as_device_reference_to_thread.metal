// expect: address-space
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* buf [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  thread float& r = buf[i];  // error
  r += 1.0f;
}
