// expect: member-address-space
#include <metal_stdlib>
using namespace metal;

struct Counter {
  uint n;
  void add(uint v) { n += v; }
};
kernel void k(device uint* out [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup Counter c;
  if (i == 0) c.add(1);  // error
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = c.n;
}
