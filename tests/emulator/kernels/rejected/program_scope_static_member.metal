// expect: program-scope
#include <metal_stdlib>
using namespace metal;

struct Tile {
  static int rows;  // error
};
int Tile::rows = 8;
kernel void k(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] = Tile::rows; }
