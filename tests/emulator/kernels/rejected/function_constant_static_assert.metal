// expect: function-constant
#include <metal_stdlib>
using namespace metal;

constant bool use_bias [[function_constant(0)]];
constant int width [[function_constant(1)]];

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  static_assert(width % 4 == 0, "width must be a multiple of 4");  // error
  out[i] = 0.0f;
}
