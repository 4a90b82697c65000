// expect: member-address-space
#include <metal_stdlib>
using namespace metal;

struct Params {
  float scale;
  float scaled(float x) const { return x * scale; }
};
kernel void k(constant Params& p [[buffer(0)]], device float* out [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  out[i] = p.scaled(out[i]);  // error
}
