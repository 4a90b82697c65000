// expect: thread_local
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  thread_local float carry = 0.0f;  // error
  out[i] += carry;
}
