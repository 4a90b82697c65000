// Included by language.metal: a project header with templates, enums and constexpr.
#pragma once
#include <metal_stdlib>
using namespace metal;

enum class Op : int { Add = 0, Mul = 1 };
constexpr constant int kScale = 3;

template <typename T, Op op>
METAL_FUNC_INLINE T apply(T a, T b) {
  return op == Op::Add ? a + b : a * b;
}

struct Params {
  uint n;
  float alpha;
  int4 ivec;
  packed_float3 p3;
  float tail;
};
