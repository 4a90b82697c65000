// expect: goto
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  if (out[i] < 0.0f) goto done;  // error
  out[i] = sqrt(out[i]);
done:
  return;
}
