// expect: division-by-zero
#include <metal_stdlib>
using namespace metal;

kernel void k(device uint* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = i / 0;  // error
}
