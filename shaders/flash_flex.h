// FlexAttention hooks of the attention kernels (flash_fwd.metal, flash_bwd.metal).
//
// A FlexAttention source (generated on the host, torch_metal_flash/planner/flex.py)
// defines FLASH_FLEX and the namespace `flex` -- score_mod, its derivative
// score_grad, mask_mod, the Captured tensors they read, and for the reads of
// captured tensors that need a gradient, per line (row, col, diag) their
// derivatives and indices -- then includes the kernel templates and
// instantiates the tiles it needs.  Without FLASH_FLEX the hooks below are inert
// (kFlex is false, no reads: the plain kernels compile as before).
//
// Block sparsity: a BlockMask lists, per row block of the outer loop (a query
// block for the forward and dQ kernels, a key block for dK/dV), the inner
// blocks that are partly visible (mask_mod evaluated) and those fully visible
// (mask_mod skipped).  The inner loop walks those lists, tile by tile; blocks
// on neither list are never loaded.  The host remaps the BlockMask so that its
// block sizes are multiples of every kernel tile (a threadgroup's rows lie in
// one row block, a step's keys in one inner block).  A BlockMask's blocks of 16
// or 32 (dividing the 64 of every tile) stay blocks of their own as sub-blocks
// of 64: each listed partial block carries a word of 2-bit states (0 hidden,
// 1 mask_mod, 2 visible) of its sub-blocks, and a step loads only the 16-row
// chunks of its tile that some sub-block of the threadgroup's rows sees (the
// others are zero-filled, their elements hidden); a step with none is skipped.
//
// Gradients of captured tensors (the backward): a read whose index depends on
// q but not kv is summed along each query row by the dQ kernel, one whose index
// depends on kv but not q along each key column by the dK/dV kernel (per query
// head), one whose index depends on q and kv through q - kv along each diagonal
// by flash_bwd_diag.  Each line's sum goes to its own FlexPartial with the
// line's index into the tensor (flex_grad_entry: rows, then columns, then
// diagonals, each read a (B, Hq, lines) block); the host adds the partials of
// one index in a fixed order (flash_bwd_segment_sum).  No atomics.
//
// Buffers (indices 16..30, unused by the plain kernels): 16 FlexParams, 17/18
// partial counts (batch, heads, rows) and indices (batch, heads, rows, cols),
// 19/20 the full ones, 21 the captured tensors' sizes then strides, 22 the gradient
// partials (backward, when there are reads), 23.. the captured tensors.
#pragma once

#include <metal_stdlib>
#include "flash_frag.h"
#include "flash_loader.h"
#include "flash_params.h"

using namespace metal;

namespace flash {

// Host mirror: torch_metal_flash/planner/flex.py.
struct FlexParams {
  int row_block;  // positions per row block of the lists (query or key positions)
  int col_block;  // positions per listed block
  int rows;       // row blocks
  int cols;       // index columns per row
  int batch;      // 1 (broadcast over the batch) or the batch
  int heads;      // 1 (broadcast over the query heads) or the query heads
  int has_full;   // whether the full lists are bound
  int row_sub;    // positions per sub-block along the rows (0: whole blocks)
  int col_sub;    // positions per sub-block along the listed blocks (0: whole blocks)
  int pad_i;
};

// Sub-block state words: every 2-bit field 2 (visible), or 1 (mask_mod).
constant constexpr uint kFlexFullWord = 0xAAAAAAAAu;
constant constexpr uint kFlexPartialWord = 0x55555555u;
// Positions per load chunk of a tile (sub-blocks are multiples of it).
constant constexpr int kFlexChunk = 16;

// The sub-block geometry of a list direction, read from the params once per
// kernel (kept in registers: the element loop reads no constant buffer).
struct FlexSub {
  int row_block;
  int col_block;
  int row_sub;  // 0: whole row blocks
  int col_sub;  // 0: whole listed blocks

  // The state (0 hidden, 1 mask_mod, 2 visible) of the element at outer
  // position `outer`, inner position `inner` of a block with state word `word`.
  int state(uint word, int outer, int inner) const {
    if (word == kFlexFullWord) return 2;
    if (word == kFlexPartialWord) return 1;
    const int r = row_sub > 0 ? (outer % row_block) / row_sub : 0;
    const int c = col_sub > 0 ? (inner % col_block) / col_sub : 0;
    const int per_row = col_sub > 0 ? col_block / col_sub : 1;
    return int(word >> (2 * (r * per_row + c))) & 3;
  }

  // Bit c: chunk c (CHUNK inner positions from `inner` + c * CHUNK) holds a
  // sub-block that some outer position in [o_first, o_last] does not hide.
  template <int CHUNK, int N>
  uint chunks(uint word, int o_first, int o_last, int inner) const {
    if (word == kFlexFullWord || word == kFlexPartialWord) return (1u << N) - 1u;
    const int r_step = row_sub > 0 ? row_sub : row_block;
    uint bits = 0;
    for (int c = 0; c < N; ++c) {
      for (int o = o_first - o_first % r_step; o <= o_last; o += r_step) {
        if (state(word, o, inner + c * CHUNK) != 0) bits |= 1u << c;
      }
    }
    return bits;
  }
};

inline FlexSub flex_sub(constant FlexParams& p) {
  return FlexSub{p.row_block, p.col_block, p.row_sub, p.col_sub};
}

// A line's gradient sum and where it goes (index -1: nowhere, a read out of range).
struct FlexPartial {
  int index;
  float value;
};

struct FlexLists {
  constant FlexParams* p;
  const device int* num;
  const device int* idx;
  const device int* full_num;
  const device int* full_idx;
};

// A tile of ROWS rows in chunks of CH rows (flash::load_tile), those whose bit
// in `chunks` is clear zero-filled and never read (hidden sub-blocks).
template <typename T, int ROWS, int COLS, int NT, int CH>
inline void load_tile_chunks(threadgroup T* dst, int dst_ld, const device T* src, long src_ld, int rows_valid,
                             int cols_valid, bool cols_aligned, ushort tid, uint chunks) {
  if (chunks == (1u << (ROWS / CH)) - 1u) {
    load_tile<T, ROWS, COLS, NT>(dst, dst_ld, src, src_ld, rows_valid, cols_valid, cols_aligned, false, tid);
    return;
  }
  for (int c = 0; c < ROWS / CH; ++c) {
    load_tile<T, CH, COLS, NT>(dst + c * CH * dst_ld, dst_ld, src + long(c * CH) * src_ld, src_ld,
                               (chunks >> c) & 1u ? rows_valid - c * CH : 0, cols_valid, cols_aligned, false, tid);
  }
}

// The inner loop's steps: a plain range begin, begin + tile, ... (count steps),
// or the blocks of a BlockMask row, partial ones first, each `per_block` tiles.
struct InnerSteps {
  int count;
  int begin;
  int tile;
  int per_block;
  int col_block;
  int n_partial;
  int words;  // offset of the partial blocks' state words after their indices (0: none)
  FlexSub sub;
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
  // `word`: the state word of the step's block (FlexSub::state).
  int at(int t, thread uint& word) const {
    if (partial == nullptr) {
      word = kFlexPartialWord;
      return begin + t * tile;
    }
    const int e = t / per_block;
    const bool is_full = e >= n_partial;
    word = is_full ? kFlexFullWord : words > 0 ? uint(partial[words + e]) : kFlexPartialWord;
    const int blk = is_full ? full[e - n_partial] : partial[e];
    const long first = long(blk) * col_block + long(t - e * per_block) * tile;
    return blk < 0 || first > 0x7fffffffL ? -1 : int(first);
  }
};

// The list row of BlockMask row block holding position `pos` (of the outer
// loop) of batch b, query head h, or -1 past the rows.
inline long flex_list_row(constant FlexParams& p, int b, int h, int pos) {
  const int row = pos / p.row_block;
  if (row < 0 || row >= p.rows) return -1;
  return (long(p.batch > 1 ? b : 0) * p.heads + (p.heads > 1 ? h : 0)) * p.rows + row;
}

// The steps of the BlockMask row holding position `pos`, `tile` positions per
// step over the `extent` positions of the inner loop (a block larger than the
// problem, e.g. torch's 2^30 of a BlockMask without sparsity, takes only the
// steps inside it).  Counts are clamped to the index columns.
inline InnerSteps flex_steps(FlexLists l, int b, int h, int pos, int tile, int extent) {
  constant FlexParams& p = *l.p;
  InnerSteps s{};
  s.tile = tile;
  s.per_block = (min(p.col_block, max(extent, 1)) + tile - 1) / tile;
  s.sub = flex_sub(p);
  s.col_block = p.col_block;
  const long r = flex_list_row(p, b, h, pos);
  if (r < 0) return s;
  s.n_partial = clamp(l.num[r], 0, p.cols);
  const bool sub = p.row_sub > 0 || p.col_sub > 0;
  s.words = sub ? p.cols : 0;
  s.partial = l.idx + r * (sub ? 2 : 1) * p.cols;
  const int n_full = p.has_full ? clamp(l.full_num[r], 0, p.cols) : 0;
  s.full = p.has_full ? l.full_idx + r * p.cols : s.partial;
  s.count = (s.n_partial + n_full) * s.per_block;
  return s;
}

// The state word of the block holding (pos, col_pos): 0 not listed (never
// visible), else its FlexSub::state word.
inline uint flex_block_word(FlexLists l, int b, int h, int pos, int col_pos) {
  constant FlexParams& p = *l.p;
  const long r = flex_list_row(p, b, h, pos);
  if (r < 0) return 0u;
  const int blk = col_pos / p.col_block;
  if (p.has_full) {
    const int n = clamp(l.full_num[r], 0, p.cols);
    for (int e = 0; e < n; ++e) {
      if (l.full_idx[r * p.cols + e] == blk) return kFlexFullWord;
    }
  }
  const bool sub = p.row_sub > 0 || p.col_sub > 0;
  const long row = r * (sub ? 2 : 1) * p.cols;
  const int n = clamp(l.num[r], 0, p.cols);
  for (int e = 0; e < n; ++e) {
    if (l.idx[row + e] == blk) return sub ? uint(l.idx[row + p.cols + e]) : kFlexPartialWord;
  }
  return 0u;
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
#define FLEX_PARAMS_PTR (&flex_p)
#define FLEX_CAPTURED FLEX_CAPTURED_INIT
#if FLEX_ROW_READS + FLEX_COL_READS + FLEX_DIAG_READS > 0
#define FLEX_GRAD_PARAMS device flash::FlexPartial* flex_grads [[buffer(22)]],
#define FLEX_GRADS flex_grads
#endif
#else
constant constexpr bool kFlex = false;
#define FLEX_HAS_SCORE_MOD 0
#define FLEX_HAS_MASK_MOD 0
#define FLEX_ROW_READS 0
#define FLEX_COL_READS 0
#define FLEX_DIAG_READS 0
#define FLEX_KERNEL_PARAMS
#define FLEX_LISTS flash::FlexLists{nullptr, nullptr, nullptr, nullptr, nullptr}
#define FLEX_PARAMS_PTR static_cast<constant flash::FlexParams*>(nullptr)
#define FLEX_CAPTURED flex::Captured{0}
namespace flex {
struct Captured {
  int unused;
};
inline float score_mod(float s, int, int, int, int, thread const Captured&) { return s; }
inline float score_grad(float, int, int, int, int, thread const Captured&) { return 1.0f; }
inline bool mask_mod(int, int, int, int, thread const Captured&) { return true; }
inline void row_grads(float, int, int, int, int, thread const Captured&, thread float*) {}
inline void col_grads(float, int, int, int, int, thread const Captured&, thread float*) {}
inline void diag_grads(float, int, int, int, int, thread const Captured&, thread float*) {}
inline int row_index(int, int, int, int, int, thread const Captured&) { return -1; }
inline int col_index(int, int, int, int, int, thread const Captured&) { return -1; }
inline int diag_index(int, int, int, int, int, thread const Captured&) { return -1; }
}  // namespace flex
#endif
#ifndef FLEX_GRAD_PARAMS
#define FLEX_GRAD_PARAMS
#define FLEX_GRADS static_cast<device flash::FlexPartial*>(nullptr)
#endif

namespace flash {

// Slots of the per-line gradient accumulators (arrays need one element).
constant constexpr int kFlexRowSlots = FLEX_ROW_READS > 0 ? FLEX_ROW_READS : 1;
constant constexpr int kFlexColSlots = FLEX_COL_READS > 0 ? FLEX_COL_READS : 1;
constant constexpr int kFlexDiagSlots = FLEX_DIAG_READS > 0 ? FLEX_DIAG_READS : 1;

// The flex part of the score of element (i, j) of batch b, query head h: hidden
// in a hidden sub-block, mask_mod in a partial one (`state`: FlexSub::state),
// then score_mod on the score x.  `vis` in: inside the problem; out: visible
// (a score_mod result <= -FLT_MAX, torch's -inf, hides the element).  `grad`,
// when asked: d score / d x.
template <bool GRAD>
inline float flex_score(float x, int b, int h, int i, int j, int state, thread const flex::Captured& c,
                        thread bool& vis, thread float& grad) {
  if (!vis) return x;
  vis = state != 0;
  if (FLEX_HAS_MASK_MOD && state == 1) vis = flex::mask_mod(b, h, i, j, c);
  if (!FLEX_HAS_SCORE_MOD || !vis) return x;
  const float s = flex::score_mod(x, b, h, i, j, c);
  vis = s > -FLT_MAX;
  if (GRAD) grad = flex::score_grad(x, b, h, i, j, c);
  return s;
}

// Whether the elements of a block with state word `word` need flex_score
// (a full block without a score_mod needs nothing per element).
inline bool flex_elements(uint word) {
  return kFlex && (FLEX_HAS_SCORE_MOD || (word != kFlexFullWord && (FLEX_HAS_MASK_MOD || word != kFlexPartialWord)));
}

// Lines of a walk (0 rows, 1 columns, 2 diagonals i - j + Lk - 1) and the
// FlexPartial of line `line` of read `slot` of batch b, query head h.
inline long flex_grad_entry(int walk, int slot, int b, int h, int line, constant FlashFwdParams& f) {
  const long bh = long(f.batch) * f.heads;
  const long rows = bh * f.seqlen_q;
  const long cols = bh * f.seqlen_k;
  const int diag_lines = f.seqlen_q + f.seqlen_k - 1;
  const int lines = walk == 0 ? f.seqlen_q : walk == 1 ? f.seqlen_k : diag_lines;
  long base = walk == 0 ? 0 : walk == 1 ? FLEX_ROW_READS * rows : FLEX_ROW_READS * rows + FLEX_COL_READS * cols;
  base += slot * (bh * lines);
  return base + (long(b) * f.heads + h) * lines + line;
}

// Add the element's contributions ds * d score_mod / d read to the row (or
// column) accumulators of the reads of that walk.
template <int WALK>
inline void flex_line_grads(thread float* acc, float ds, float x, int b, int h, int i, int j,
                            thread const flex::Captured& c) {
  constexpr int n = WALK == 0 ? FLEX_ROW_READS : FLEX_COL_READS;
  if (n == 0) return;
  float g[WALK == 0 ? kFlexRowSlots : kFlexColSlots];
  if (WALK == 0) {
    flex::row_grads(x, b, h, i, j, c, g);
  } else {
    flex::col_grads(x, b, h, i, j, c, g);
  }
  for (int r = 0; r < n; ++r) acc[r] += ds * g[r];
}

// The line sums of a row (WALK 0: row i = `line`) or column (WALK 1: key j =
// `line`) walk: summed over the 4 lanes that share a fragment row, then
// written by the first of them (`write`: the line is inside the problem).
template <int WALK>
inline void flex_store_lines(device FlexPartial* out, thread const float* acc, int b, int h, int line, bool write,
                             FragCoord fc, constant FlashFwdParams& f, thread const flex::Captured& c) {
  constexpr int n = WALK == 0 ? FLEX_ROW_READS : FLEX_COL_READS;
  for (int r = 0; r < n; ++r) {
    const float total = row_sum(acc[r]);
    if (write && fc.col == 0) {
      const int index = WALK == 0 ? flex::row_index(r, b, h, line, 0, c) : flex::col_index(r, b, h, 0, line, c);
      out[flex_grad_entry(WALK, r, b, h, line, f)] = FlexPartial{index, total};
    }
  }
}

}  // namespace flash
