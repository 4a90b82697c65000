// expect: member-address-space
#include <metal_stdlib>
using namespace metal;

struct Range {
  uint lo, hi;
  uint size() const { return hi - lo; }
};
kernel void k(device const Range* ranges [[buffer(0)]], device uint* out [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  out[i] = ranges[i].size();  // error
}
