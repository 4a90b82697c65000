// expect: address-space
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  threadgroup float tile[32];
  device float* p = tile;  // error
  p[i % 32] = out[i];
}
