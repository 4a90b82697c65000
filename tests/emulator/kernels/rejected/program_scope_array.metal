// expect: program-scope
#include <metal_stdlib>
using namespace metal;

const float taps[3] = {0.25f, 0.5f, 0.25f};  // error
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] *= taps[i % 3]; }
