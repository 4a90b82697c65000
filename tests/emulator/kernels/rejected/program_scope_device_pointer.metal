// expect: program-scope
#include <metal_stdlib>
using namespace metal;

device float* scratch;  // error
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] = 0.0f; }
