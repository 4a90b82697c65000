// expect: program-scope
#include <metal_stdlib>
using namespace metal;

float bias = 0.5f;  // error
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] += bias; }
