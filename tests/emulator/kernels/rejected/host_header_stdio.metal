// expect: host-header
#include <metal_stdlib>
using namespace metal;

#include <stdio.h>  // error
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] = 0.0f; }
