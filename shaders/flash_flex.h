// FlexAttention hooks of the attention kernels (flash_fwd.metal, flash_bwd.metal).
//
// A FlexAttention source (generated on the host, torch_metal_flash/flex) defines
// FLASH_FLEX and the namespace `flex` -- score_mod, its derivative score_grad,
// mask_mod and the Captured tensors they read -- then includes the kernel
// templates and instantiates the tiles it needs.  Without FLASH_FLEX the hooks
// below are inert (kFlex is false: the plain kernels compile as before).
//
// Block sparsity: a BlockMask lists, per row block of the outer loop (a query
// block for the forward and dQ kernels, a key block for dK/dV), the inner
// blocks that are partly visible (mask_mod evaluated) and those fully visible
// (mask_mod skipped).  The inner loop walks those lists, tile by tile; blocks
// on neither list are never loaded.  The host remaps the BlockMask so that its
// block sizes are multiples of every kernel tile (a threadgroup's rows lie in
// one row block, a step's keys in one inner block).
//
// Buffers (indices 16..30, unused by the plain kernels): 16 FlexParams, 17/18
// partial counts (batch, heads, rows) and indices (batch, heads, rows, cols),
// 19/20 the full ones, 21 the captured tensors' sizes, 22.. the captured tensors.
#pragma once

#include <metal_stdlib>

using namespace metal;

namespace flash {

// Host mirror: torch_metal_flash/flex/params.py.
struct FlexParams {
  int row_block;  // positions per row block of the lists (query or key positions)
  int col_block;  // positions per listed block
  int rows;       // row blocks
  int cols;       // index columns per row
  int batch;      // 1 (broadcast over the batch) or the batch
  int heads;      // 1 (broadcast over the query heads) or the query heads
  int has_full;   // whether the full lists are bound
  int pad_i;
};

struct FlexLists {
  constant FlexParams* p;
  const device int* num;
  const device int* idx;
  const device int* full_num;
  const device int* full_idx;
};

// The inner loop's steps: a plain range begin, begin + tile, ... (count steps),
// or the blocks of a BlockMask row, partial ones first, each `per_block` tiles.
struct InnerSteps {
  int count;
  int begin;
  int tile;
  int per_block;
  int col_block;
  int n_partial;
  const device int* partial;
  const device int* full;

  static InnerSteps range(int begin, int end, int tile) {
    InnerSteps s{};
    s.count = end > begin ? (end - begin + tile - 1) / tile : 0;
    s.begin = begin;
    s.tile = tile;
    return s;
  }

  // The first position of step t (-1: a listed block out of range, skip it);
  // `is_full`: the step lies in a fully visible block.
  int at(int t, thread bool& is_full) const {
    if (partial == nullptr) {
      is_full = false;
      return begin + t * tile;
    }
    const int e = t / per_block;
    is_full = e >= n_partial;
    const int blk = is_full ? full[e - n_partial] : partial[e];
    return blk < 0 ? -1 : blk * col_block + (t - e * per_block) * tile;
  }
};

// The steps of the BlockMask row holding position `pos` (of the outer loop) of
// batch b, query head h, `tile` positions per step.  Counts are clamped to the
// index columns.
inline InnerSteps flex_steps(FlexLists l, int b, int h, int pos, int tile) {
  constant FlexParams& p = *l.p;
  const int row = pos / p.row_block;
  InnerSteps s{};
  s.tile = tile;
  s.per_block = p.col_block / tile;
  s.col_block = p.col_block;
  if (row < 0 || row >= p.rows) {
    return s;
  }
  const long r = (long(p.batch > 1 ? b : 0) * p.heads + (p.heads > 1 ? h : 0)) * p.rows + row;
  s.n_partial = clamp(l.num[r], 0, p.cols);
  s.partial = l.idx + r * p.cols;
  const int n_full = p.has_full ? clamp(l.full_num[r], 0, p.cols) : 0;
  s.full = p.has_full ? l.full_idx + r * p.cols : s.partial;
  s.count = (s.n_partial + n_full) * s.per_block;
  return s;
}

}  // namespace flash

#ifdef FLASH_FLEX
constant constexpr bool kFlex = true;
#define FLEX_KERNEL_PARAMS                                                                      \
  constant flash::FlexParams& flex_p [[buffer(16)]], const device int* flex_num [[buffer(17)]], \
      const device int* flex_idx [[buffer(18)]], const device int* flex_full_num [[buffer(19)]], \
      const device int* flex_full_idx [[buffer(20)]], constant int* flex_dims [[buffer(21)]],   \
      FLEX_CAPTURED_PARAMS
#define FLEX_LISTS flash::FlexLists{&flex_p, flex_num, flex_idx, flex_full_num, flex_full_idx}
#define FLEX_CAPTURED FLEX_CAPTURED_INIT
#else
constant constexpr bool kFlex = false;
#define FLEX_HAS_SCORE_MOD 0
#define FLEX_HAS_MASK_MOD 0
#define FLEX_KERNEL_PARAMS
#define FLEX_LISTS flash::FlexLists{nullptr, nullptr, nullptr, nullptr, nullptr}
#define FLEX_CAPTURED flex::Captured{0}
namespace flex {
struct Captured {
  int unused;
};
inline float score_mod(float s, int, int, int, int, thread const Captured&) { return s; }
inline float score_grad(float, int, int, int, int, thread const Captured&) { return 1.0f; }
inline bool mask_mod(int, int, int, int, thread const Captured&) { return true; }
}  // namespace flex
#endif

namespace flash {

// The flex part of the score of element (i, j) of batch b, query head h: mask_mod
// (outside fully visible blocks), then score_mod on the score x.  `vis` in:
// inside the problem; out: visible (a score_mod result <= -FLT_MAX, torch's
// -inf, hides the element).  `grad`, when asked: d score / d x.
template <bool GRAD>
inline float flex_score(float x, int b, int h, int i, int j, bool full, thread const flex::Captured& c,
                        thread bool& vis, thread float& grad) {
  if (!vis) return x;
  if (FLEX_HAS_MASK_MOD && !full) vis = flex::mask_mod(b, h, i, j, c);
  if (!FLEX_HAS_SCORE_MOD || !vis) return x;
  const float s = flex::score_mod(x, b, h, i, j, c);
  vis = s > -FLT_MAX;
  if (GRAD) grad = flex::score_grad(x, b, h, i, j, c);
  return s;
}

}  // namespace flash
