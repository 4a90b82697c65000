// expect: program-scope
#include <metal_stdlib>
using namespace metal;

kernel void k(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  static int calls = 0;  // error
  out[i] = calls;
}
