// expect: buffer-address-space
#include <metal_stdlib>
using namespace metal;

kernel void k(device const float* x [[buffer(0)]],
              float* out [[buffer(1)]],  // error
              uint i [[thread_position_in_grid]]) {
  out[i] = x[i];
}
