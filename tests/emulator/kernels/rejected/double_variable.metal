// expect: double
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  double acc = out[i];  // error
  out[i] = float(acc * 2);
}
