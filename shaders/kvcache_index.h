// The index vectors of a KV-cache call (cache_seqlens, cache_leftpad,
// cache_batch_idx, block_table), read on the GPU by the append kernel
// (kvcache_append.metal) and the decode kernel (flash_decode.metal).
//
// The host checks only shapes and dtypes, so any value may arrive here.  Out-of-
// range values are clamped or ignored, never used to address memory outside
// the caches (docs/kvcache.md, "Index values"; TORCH_METAL_FLASH_DEBUG=1
// validates them on the host instead):
//   base  = clamp(cache_seqlens[b], 0, capacity)   first appended position
//   end   = min(base + seqlen_new, capacity)       new rows past the capacity are dropped
//   start = clamp(cache_leftpad[b], 0, end)        keys of row b: positions [start, end)
//   cache row cache_batch_idx[b] outside [0, cache_rows): the batch row is ignored
//     (nothing appended, no keys: zero output, lse = +inf)
//   block_table[b, p / page_size] outside [0, cache_rows): the page is ignored
//     (nothing appended there, its positions are not keys)
// capacity = L_max (contiguous) or max_blocks * page_size (paged); cache_rows =
// the caches' first dim (batch_cache or num_blocks).
#pragma once

#include <metal_stdlib>

struct KvRow {
  int base;   // where the new rows go
  int start;  // keys: [start, end)
  int end;
};

// ignored: the batch row's cache row is out of range (no append, no keys).
inline KvRow kv_row(int seqlen, int leftpad, bool ignored, int seqlen_new, int capacity) {
  KvRow r;
  r.base = metal::clamp(seqlen, 0, capacity);
  r.end = metal::min(r.base + seqlen_new, capacity);
  r.start = ignored ? r.end : metal::clamp(leftpad, 0, r.end);
  return r;
}

// Cache row cache_batch_idx[b] = idx of a contiguous cache, or -1 (ignored).
inline int kv_cache_row(int idx, int cache_rows) {
  return (idx >= 0 && idx < cache_rows) ? idx : -1;
}

// Block holding page `page` of a paged row (its block-table row `bt_row`), or -1 (ignored).
inline long kv_block(const device int* bt_row, int page, int cache_rows) {
  const int blk = bt_row[page];
  return (blk >= 0 && blk < cache_rows) ? long(blk) : -1L;
}
