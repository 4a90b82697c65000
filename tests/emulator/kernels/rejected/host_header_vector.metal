// expect: host-header
#include <metal_stdlib>
using namespace metal;

#include <vector>  // error
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] = 0.0f; }
