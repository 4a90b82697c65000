// expect: builtin-type
#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]],
              uint2 lid [[thread_index_in_threadgroup]]) {  // error
  out[lid.x] = 0.0f;
}
