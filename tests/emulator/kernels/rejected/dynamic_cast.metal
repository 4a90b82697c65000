// expect: dynamic_cast
#include <metal_stdlib>
using namespace metal;

struct A { int v; };
struct B : A { int w; };
kernel void k(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  B b{};
  thread A* a = &b;
  out[i] = dynamic_cast<thread B*>(a)->w;  // error
}
