// Function constants: globals, optional buffers, derived constants, is_function_constant_defined.
#include <metal_stdlib>
using namespace metal;

constant bool has_bias [[function_constant(0)]];
constant float scale [[function_constant(1)]];
constant int mode [[function_constant(2)]];
constant bool scale_defined = is_function_constant_defined(scale);
constant bool bias_and_mode = has_bias && mode > 1;

kernel void fc_kernel(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                      device const float* bias [[buffer(2), function_constant(has_bias)]],
                      uint i [[thread_position_in_grid]]) {
  float v = x[i] * (scale_defined ? scale : 1.0f);
  if (has_bias) v += bias[i];
  if (bias_and_mode) v = -v;
  switch (mode) {
    case 0: break;
    default: v += float(mode) * 1000.0f;
  }
  y[i] = v;
}
