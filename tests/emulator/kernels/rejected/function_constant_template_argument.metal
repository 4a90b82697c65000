// expect: function-constant
#include <metal_stdlib>
using namespace metal;

constant bool use_bias [[function_constant(0)]];
constant int width [[function_constant(1)]];

template <int W>
float scaled(float x) { return x * W; }
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = scaled<width>(out[i]);  // error
}
