// expect: read-only
#include <metal_stdlib>
using namespace metal;

kernel void k(constant float* table [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  table[i] = 0.0f;  // error
}
