// expect: return-stack-address
#include <metal_stdlib>
using namespace metal;

static thread float* scratch_row(float x) {
  float row[4] = {x, x, x, x};
  return row;  // error
}
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = scratch_row(out[i])[0];
}
