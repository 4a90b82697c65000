// expect: language-version
// language_version: 3.1
// Metal 4's tensor ops under MSL 3.1: Apple's compiler needs -std=metal4.0.
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>  // error
using namespace metal;

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = 1.0f;
}
