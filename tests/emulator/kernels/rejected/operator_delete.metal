// expect: new-delete
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float x = out[i];
  thread float* p = &x;
  delete p;  // error
}
