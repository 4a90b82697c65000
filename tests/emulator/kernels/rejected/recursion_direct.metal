// expect: recursion
#include <metal_stdlib>
using namespace metal;

static uint tree_depth(uint n) {
  return n <= 1 ? 0 : 1 + tree_depth(n / 2);  // error
}
kernel void k(device uint* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] = tree_depth(i); }
