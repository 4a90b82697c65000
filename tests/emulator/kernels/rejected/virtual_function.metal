// expect: virtual
#include <metal_stdlib>
using namespace metal;

struct Op {
  virtual float apply(float x) const { return x; }  // error
};
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { Op op; out[i] = op.apply(out[i]); }
