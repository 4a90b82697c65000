// expect: vla
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  float tmp[n];  // error
  tmp[0] = out[i];
  out[i] = tmp[0];
}
