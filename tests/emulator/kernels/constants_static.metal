// Function constants used where C++ needs constant expressions: the emulator
// builds one library per combination of values (they are compile-time constants).
#include <metal_stdlib>
using namespace metal;

constant int tile [[function_constant(0)]];
constant bool use_fast [[function_constant(1)]];

template <int N>
float sum_n(device const float* x) {
  float s = 0;
  for (int i = 0; i < N; i++) s += x[i];
  return s;
}

kernel void fc_static(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                      uint i [[thread_position_in_grid]]) {
  threadgroup float scratch[tile];
  if (i < uint(tile)) scratch[i] = 0;
  if constexpr (use_fast) {
    y[i] = sum_n<tile>(x) + 0.5f;
  } else {
    y[i] = sum_n<tile>(x);
  }
}
