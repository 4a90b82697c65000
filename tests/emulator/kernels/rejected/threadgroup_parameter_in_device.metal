// expect: buffer-address-space
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]],
              device float* scratch [[threadgroup(0)]],  // error
              uint i [[thread_position_in_grid]]) {
  scratch[i] = 1.0f;
  out[i] = scratch[i];
}
