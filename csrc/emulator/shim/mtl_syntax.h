// What the pre-pass's parse of a source (torch_metal_flash/emulator/syntax.py) adds to the
// shim: the type its view writes in place of the vector type of a C-style or static cast,
// `(__V   )x` for `(half4)x`, `static_cast<__V   >(x)`.  Any operand converts to it, so clang
// keeps every such cast in its AST -- a vector cast C++ for OpenCL rejects (`(half4)f4`,
// elements of another size) included.
#pragma once
#include "mtl_shim.h"
struct __V {
  template <class T> __V(T&&);
};
