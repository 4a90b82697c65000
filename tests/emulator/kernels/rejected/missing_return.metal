// expect: missing-return
#include <metal_stdlib>
using namespace metal;

static float clamp01(float x) {
  if (x < 0.0f) return 0.0f;
  if (x <= 1.0f) return x;
}  // error
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] = clamp01(out[i]); }
