// expect: typeid
#include <metal_stdlib>
using namespace metal;

struct A { int v; };
kernel void k(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  A a{1};
  out[i] = typeid(a) == typeid(A);  // error
}
