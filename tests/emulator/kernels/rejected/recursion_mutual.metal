// expect: recursion
#include <metal_stdlib>
using namespace metal;

static bool is_odd(uint n);
static bool is_even(uint n) { return n == 0 ? true : is_odd(n - 1); }
static bool is_odd(uint n) {
  return n == 0 ? false : is_even(n - 1);  // error
}
kernel void k(device uint* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] = is_even(i); }
