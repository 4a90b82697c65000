// expect: builtin-type
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]],
              float gid [[thread_position_in_grid]]) {  // error
  out[0] = gid;
}
