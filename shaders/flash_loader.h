// Cooperative tile loaders: device memory -> a threadgroup tile, guarded and
// zero-padded, contiguous or through a paged block table.  Every thread of
// the threadgroup calls them; they contain no barrier.
#pragma once

#include <metal_stdlib>

using namespace metal;

namespace flash {

// Element padding of threadgroup tile rows: 16 bytes per row against bank
// conflicts (4 floats, 8 halves/bfloats).
template <typename T>
struct TilePad {
  static constant constexpr int value = 16 / sizeof(T);
};

// Threadgroup memory of every Apple GPU (maxThreadgroupMemoryLength).
constant constexpr int kThreadgroupBytes = 32768;

// The row stride of ROWS tile rows of BD elements: padded while the padded
// rows fit in threadgroup memory, else unpadded (float32 at head dim 512:
// two 8-row tiles fill the 32 KiB exactly).  planner/backward_tiles.py
// mirrors this rule.
template <typename T, int BD, int ROWS>
struct TileLD {
  static constant constexpr int value =
      ROWS * (BD + TilePad<T>::value) * int(sizeof(T)) <= kThreadgroupBytes ? BD + TilePad<T>::value : BD;
};

// ---------------------------------------------------------------------------
// Cooperative tile loader: ROWS x COLS elements from device (row stride
// src_ld, contiguous columns) into a threadgroup tile (row stride dst_ld),
// by NT threads.  Rows >= rows_valid and columns >= cols_valid are written as
// zero and never read from device.  Every thread of the threadgroup must call
// it (it contains no barrier).
//
// vec_ok: src and src_ld are aligned to 4 elements and dst_ld, COLS are
// multiples of 4, so full tiles move as 4-element vectors.
// ---------------------------------------------------------------------------
template <typename T, int ROWS, int COLS, int NT>
__attribute__((always_inline)) inline
void load_tile(threadgroup T* dst, int dst_ld, const device T* src, long src_ld,
               int rows_valid, int cols_valid, bool cols_aligned, bool vec_ok, ushort tid) {
  constexpr int kTotal = ROWS * COLS;
  if (cols_aligned && rows_valid >= ROWS) {
    if (vec_ok) {
      static_assert(COLS % 4 == 0, "vector loads need COLS % 4 == 0");
      for (int idx = tid; idx < kTotal / 4; idx += NT) {
        const int r = (idx * 4) / COLS;
        const int c = idx * 4 - r * COLS;
        *(threadgroup vec<T, 4>*)(dst + r * dst_ld + c) =
            *(const device vec<T, 4>*)(src + long(r) * src_ld + c);
      }
    } else {
      for (int idx = tid; idx < kTotal; idx += NT) {
        const int r = idx / COLS;
        const int c = idx - r * COLS;
        dst[r * dst_ld + c] = src[long(r) * src_ld + c];
      }
    }
  } else {
    for (int idx = tid; idx < kTotal; idx += NT) {
      const int r = idx / COLS;
      const int c = idx - r * COLS;
      T x = T(0.0f);
      if (r < rows_valid && c < cols_valid) x = src[long(r) * src_ld + c];
      dst[r * dst_ld + c] = x;
    }
  }
}

// Paged K/V: the element offset of key `pos` of a sequence (its block-table
// row bt_row) in a (num_blocks, Hkv, page_size, D)-indexed cache; a block
// index out of range is clamped (memory safety; debug mode validates).
inline long paged_row(const device int* bt_row, int pos, int page, int num_blocks, long stride_b,
                      long stride_l) {
  const int blk = clamp(bt_row[pos / page], 0, num_blocks - 1);
  return long(blk) * stride_b + long(pos % page) * stride_l;
}

// Tile loader for paged K/V: ROWS x COLS elements of keys kb.. (row
// addresses through the block table), zero past rows_valid / cols_valid.
template <typename T, int ROWS, int COLS, int NT>
inline void load_tile_paged(threadgroup T* dst, int dst_ld, const device T* base, long stride_b, long stride_l,
                            const device int* bt_row, int page, int num_blocks, int kb, int rows_valid,
                            int cols_valid, ushort tid) {
  for (int idx = tid; idx < ROWS * COLS; idx += NT) {
    const int r = idx / COLS;
    const int c = idx - r * COLS;
    T x = T(0.0f);
    if (r < rows_valid && c < cols_valid) {
      x = base[paged_row(bt_row, kb + r, page, num_blocks, stride_b, stride_l) + c];
    }
    dst[r * dst_ld + c] = x;
  }
}

}  // namespace flash
