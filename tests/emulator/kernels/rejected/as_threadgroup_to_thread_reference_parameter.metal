// expect: address-space
#include <metal_stdlib>
using namespace metal;

static void bump(thread float& v) { v += 1.0f; }
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  threadgroup float acc[32];
  acc[i % 32] = 0.0f;
  bump(acc[i % 32]);  // error
  out[i] = acc[i % 32];
}
