// expect: new-delete
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  thread float* tmp = new float[4];  // error
  out[i] = tmp[0];
}
