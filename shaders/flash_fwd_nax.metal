// FlashAttention-2 forward on the neural accelerators (Metal 4 tensor ops,
// MSL 4.0; GPUs of family apple10, M5): flash_fwd.metal's algorithm, buffers,
// params and function constants, with 16x16 accelerator fragments
// (flash_nax.h) in place of 8x8 simdgroup matrices.
//
// Grid as flash_fwd: (ceil(pack * max_seqlen_q / BQ), Hq / pack, num_seqs)
// threadgroups of BQ / 16 simdgroups.  Each simdgroup owns 16 query rows, each
// lane two of them (8 apart), so every per-row quantity (head, position, max,
// sum, mask row, slope, dropout stream) is held per half h.  Q stays in
// registers in its own type (the accelerators multiply it exactly; the scale
// is applied to the float scores), O as float fragments.  K/V tiles of BK rows
// stream through threadgroup memory by flash_fwd's loaders (contiguous or
// paged, zero-padded).  The online softmax is flash_fwd's: float32, natural
// units, -FLT_MAX and a `hidden` bit for invisible scores, no infinity in the
// arithmetic.
//
// Template parameters: T half or bfloat; BD head-dim tile (a multiple of 32);
// BQ query rows per threadgroup (16 per simdgroup); BK keys per step (a
// multiple of 32); SHARED_KV as in flash_fwd; DIRECT: no K/V tiles, each
// simdgroup reads its K/V fragments straight from device memory (as MLX's
// accelerator attention does): no barriers, every simdgroup reading the
// block for itself (the GPU's caches, not threadgroup memory, share it).
//
// Every feature of flash_fwd but has_probs (the debug S_dmask output): the
// planner sends such calls to flash_fwd.
#define FLASH_FWD_TEMPLATES_ONLY
#include "flash_fwd.metal"
#include "flash_nax.h"

namespace fwd_nax_detail {

// Key rows of one sequence and KV head in device memory, contiguous from row
// k0 or paged through the block-table row (the DIRECT loads' row source).
template <typename T>
struct KeyRows {
  const device T* head;
  long stride_b, stride_l;
  int k0;
  bool paged;
  const device int* bt_row;  // read when paged
  int page, num_blocks;

  const device T* row(int key) const {
    return paged ? head + flash::paged_row(bt_row, key, page, num_blocks, stride_b, stride_l)
                 : head + long(k0 + key) * stride_l;
  }
};

}  // namespace fwd_nax_detail

template <typename T, int BD, int BQ, int BK, bool SHARED_KV, bool DIRECT>
[[kernel]] void flash_fwd_nax(FLASH_FWD_ARGS(T)) {
  constexpr int WM = BQ / 16;            // simdgroups
  constexpr int NT = WM * 32;            // threads
  constexpr int LD = BD + flash::TilePad<T>::value;
  // DIRECT keeps one 16-byte placeholder (a kernel's threadgroup array cannot be empty)
  constexpr int TG_ELEMS = DIRECT ? 16 / int(sizeof(T)) : (SHARED_KV ? 1 : 2) * BK * LD;
  constexpr int NF = BD / 16;            // fragments along the head dim
  constexpr int NK = BK / 16;            // fragments along the keys
  static_assert(BQ % 16 == 0 && BK % 32 == 0 && BD % 32 == 0, "tile sizes");
  static_assert(NK * 8 <= 32, "one bit per score element of a lane in `hidden`");
  using Acc = flash::nax::Frag<float>;

  threadgroup T smem[TG_ELEMS];
  threadgroup T* Ks = smem;
  threadgroup T* Vs = SHARED_KV ? smem : smem + BK * LD;

  const int b = int(tgid.z);
  const flash::Seq sq = flash::seq_of(p, b, is_varlen, is_paged, has_seqused_k, cu_q, cu_k, seqused);
  const int Lq = sq.lq;
  const int Lk = sq.lk;
  const int rows = p.pack * Lq;
  const int q0 = int(tgid.x) * BQ;
  if (q0 >= rows) return;                // past this sequence's rows: all threads alike
  const int h0 = int(tgid.y) * p.pack;
  const int kvh = h0 / p.gqa;
  const int r0 = q0 + int(sg) * 16;      // first packed row of this simdgroup
  const flash::nax::Coord fc = flash::nax::coord(ushort(lane));
  int i_first, i_last;
  flash::packed_row_span(q0, min(q0 + BQ, rows) - 1, Lq, i_first, i_last);

  // This lane's two rows: query head hh[h], position ii[h].
  bool row_ok[2];
  int hh[2], ii[2];
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + fc.row + 8 * h;
    row_ok[h] = r < rows;
    hh[h] = h0 + (row_ok[h] ? r / Lq : 0);
    ii[h] = row_ok[h] ? r - (hh[h] - h0) * Lq : 0;
  }

  const device T* kh = k + long(sq.bt) * p.k_stride_b + long(kvh) * p.k_stride_h;
  const device T* vh = v + long(sq.bt) * p.v_stride_b + long(kvh) * p.v_stride_h;
  const device int* bt_row = is_paged ? block_table + long(b) * p.bt_stride_b : nullptr;
  const fwd_nax_detail::KeyRows<T> krows{kh, p.k_stride_b, p.k_stride_l, sq.k0, is_paged, bt_row, p.page_size,
                                         p.num_blocks};
  const fwd_nax_detail::KeyRows<T> vrows{vh, p.v_stride_b, p.v_stride_l, sq.k0, is_paged, bt_row, p.page_size,
                                         p.num_blocks};

  // Q fragments (zero past Lq and past head_dim), unscaled.
  flash::nax::Frag<T> Qf[NF];
  for (int h = 0; h < 2; ++h) {
    const device T* qrow = q + long(sq.bt) * p.q_stride_b + long(hh[h]) * p.q_stride_h +
                           long(sq.q0 + ii[h]) * p.q_stride_l;
    for (int dd = 0; dd < NF; ++dd) {
      for (int j = 0; j < 4; ++j) {
        const int d = dd * 16 + fc.col + j;
        Qf[dd].e[4 * h + j] = row_ok[h] && d < p.head_dim ? qrow[d] : T(0);
      }
    }
  }

  Acc Of[NF];
  for (int dd = 0; dd < NF; ++dd) {
    for (int e = 0; e < 8; ++e) Of[dd].e[e] = 0.0f;
  }

  // Per row: running max and sum (a sink starts the row at max = sink, sum = 1),
  // ALiBi slope, mask row, dropout stream.
  float m_i[2], l_i[2], slope[2] = {0.0f, 0.0f};
  long mask_row[2] = {0, 0};
  flash::Dropout drop[2] = {};
  for (int h = 0; h < 2; ++h) {
    m_i[h] = has_sinks ? sinks[hh[h]] : -FLT_MAX;
    l_i[h] = has_sinks ? 1.0f : 0.0f;
    if (has_alibi) slope[h] = alibi[long(b) * p.a_stride_b + long(hh[h]) * p.a_stride_h];
    if (has_mask) mask_row[h] = long(b) * p.m_stride_b + long(hh[h]) * p.m_stride_h + long(ii[h]) * p.m_stride_q;
    if (has_dropout) drop[h] = flash::dropout_of(rng, b, p.heads, hh[h], p.dropout_threshold);
  }

  const flash::Band band{sq.diag, p.window_left, p.window_right};
  int k_lo = 0, k_hi = Lk;
  if (has_band) band.key_range(i_first, i_last, Lk, k_lo, k_hi);
  const flash::ScoreFeatures feat{has_softcap, has_alibi, has_mask, mask_kind};

  const bool cols_aligned = dims_aligned;
  const bool vec_ok = kv_vec_aligned;
  for (int kb = (k_lo / BK) * BK; kb < k_hi; kb += BK) {
    const int k_valid = Lk - kb;
    if (!DIRECT) {
      fwd_detail::load_keys<T, BK, BD, NT>(Ks, LD, kh, p.k_stride_b, p.k_stride_l, sq.k0, bt_row, p, kb, k_valid,
                                          p.head_dim, cols_aligned, vec_ok, ushort(tid));
      if (!SHARED_KV) {
        fwd_detail::load_keys<T, BK, BD, NT>(Vs, LD, vh, p.v_stride_b, p.v_stride_l, sq.k0, bt_row, p, kb,
                                            k_valid, p.head_dim_v, cols_aligned, vec_ok, ushort(tid));
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // Simdgroup-uniform skip of rows past Lq or outside the band (flash_fwd's rule).
    bool sg_active = r0 < rows;
    bool need_band = false;
    if (has_band && sg_active) {
      int sg_i0, sg_i1, lo, hi;
      flash::packed_row_span(r0, min(r0 + 15, rows - 1), Lq, sg_i0, sg_i1);
      band.key_range(sg_i0, sg_i1, Lk, lo, hi);
      sg_active = kb < hi && kb + BK > lo;
      need_band = !band.block_inside(sg_i0, sg_i1, kb, kb + BK - 1);
    }
    Acc S[NK];
    if (sg_active) {
      // S = Q K^T, 32 keys per multiply, the head dim in order.
      for (int kk = 0; kk < NK; kk += 2) {
        for (int e = 0; e < 8; ++e) S[kk].e[e] = S[kk + 1].e[e] = 0.0f;
        for (int dd = 0; dd < NF; ++dd) {
          flash::nax::Frag<T> Kt[2];
          if (DIRECT) {
            flash::nax::load_rows<true>(Kt, krows, kb + kk * 16, dd * 16, Lk, p.head_dim, fc);
          } else {
            flash::nax::load_bt<T, LD>(Kt, Ks + kk * 16 * LD + dd * 16, fc);
          }
          flash::nax::mma<true>(S[kk], S[kk + 1], Qf[dd], Kt);
        }
      }
      // Scale, transform, hide (bit 8 * kk + e: element e of S[kk]).
      uint hidden = 0;
      const bool need_bounds = kb + BK > Lk;
      for (int kk = 0; kk < NK; ++kk) {
        for (int e = 0; e < 8; ++e) {
          const int h = e / 4;
          const int j = kb + kk * 16 + fc.col + e % 4;
          bool vis = !need_bounds || j < Lk;
          if (need_band) vis = vis && band.visible(ii[h], j);
          const float s = flash::transform_score(S[kk].e[e] * p.qk_scale, ii[h], j, band.diag, slope[h], p.softcap,
                                                 feat, mask, mask_row[h] + long(j) * p.m_stride_k, row_ok[h], vis).s;
          S[kk].e[e] = vis ? s : -FLT_MAX;
          hidden |= vis ? 0u : 1u << (8 * kk + e);
        }
      }
      flash::nax::softmax_step<NK, NF>(S, hidden, m_i, l_i, Of);
      if (has_dropout) {  // after the sum: the softmax sums every probability, dropped or not
        for (int kk = 0; kk < NK; ++kk) {
          for (int h = 0; h < 2; ++h) {
            const bool4 keep = drop[h].keep4(ii[h], kb + kk * 16 + fc.col);
            for (int j = 0; j < 4; ++j) S[kk].e[4 * h + j] = keep[j] ? S[kk].e[4 * h + j] : 0.0f;
          }
        }
      }
    }

    if (SHARED_KV && !DIRECT) {  // every simdgroup is done with K: bring V into the same buffer
      threadgroup_barrier(mem_flags::mem_threadgroup);
      fwd_detail::load_keys<T, BK, BD, NT>(Vs, LD, vh, p.v_stride_b, p.v_stride_l, sq.k0, bt_row, p, kb, k_valid,
                                          p.head_dim_v, cols_aligned, vec_ok, ushort(tid));
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // O += P V: P's fragments are the left operands as they are, 32 head-dim columns per multiply.
    if (sg_active) {
      for (int kk = 0; kk < NK; ++kk) {
        for (int dd = 0; dd < NF; dd += 2) {
          flash::nax::Frag<T> Vf[2];
          if (DIRECT) {
            flash::nax::load_rows<false>(Vf, vrows, kb + kk * 16, dd * 16, Lk, p.head_dim_v, fc);
          } else {
            flash::nax::load_b<T, LD>(Vf, Vs + kk * 16 * LD + dd * 16, fc);
          }
          flash::nax::mma<false>(Of[dd], Of[dd + 1], S[kk], Vf);
        }
      }
    }
    if (!DIRECT) threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // Epilogue (flash_fwd's): O / l (and 1 / (1 - p)), lse = m + ln(l), the backward's row state.
  constexpr bool kAuxOut = flash::AuxHasOut<T>::value;
  const int pitch = kAuxOut ? 2 + p.head_dim_v : 2;
  for (int h = 0; h < 2; ++h) {
    if (!row_ok[h]) continue;
    const float out_scale = flash::inv_row_sum(l_i[h]) * (has_dropout ? p.dropout_scale : 1.0f);
    device T* orow = o + long(sq.bt) * p.o_stride_b + long(hh[h]) * p.o_stride_h +
                     long(sq.q0 + ii[h]) * p.o_stride_l;
    const long stat_row = (long(sq.bt) * p.heads + hh[h]) * long(p.seqlen_q) + sq.q0 + ii[h];
    device float* arow = has_aux ? aux + stat_row * pitch : nullptr;
    for (int dd = 0; dd < NF; ++dd) {
      for (int j = 0; j < 4; ++j) {
        const int d = dd * 16 + fc.col + j;
        if (d >= p.head_dim_v) continue;
        const float x = Of[dd].e[4 * h + j] * out_scale;
        orow[d] = T(x);
        if (has_aux && kAuxOut) arow[2 + d] = x;
      }
    }
    if (fc.col == 0) {
      flash::store_lse(lse + stat_row, m_i[h], l_i[h]);
      if (has_aux) {
        arow[0] = flash::saw_keys(l_i[h]) ? m_i[h] : 0.0f;
        arow[1] = l_i[h];
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Instantiations: flash_fwd_nax_<dtype>_d<BD>_q<BQ>_k<BK>[_s|_r] ("_r": DIRECT,
// K/V read into registers); every NAX tile of torch_metal_flash/planner/tiles.py
// must appear here (a test checks).
// ---------------------------------------------------------------------------
#define FLASH_FWD_NAX_INSTANTIATE(tname, T, BD, BQ, BK)                                       \
  template [[host_name("flash_fwd_nax_" #tname "_d" #BD "_q" #BQ "_k" #BK)]] [[kernel]] void \
  flash_fwd_nax<T, BD, BQ, BK, false, false>(FLASH_FWD_ARGS(T));
#define FLASH_FWD_NAX_INSTANTIATE_SHARED(tname, T, BD, BQ, BK)                                       \
  template [[host_name("flash_fwd_nax_" #tname "_d" #BD "_q" #BQ "_k" #BK "_s")]] [[kernel]] void \
  flash_fwd_nax<T, BD, BQ, BK, true, false>(FLASH_FWD_ARGS(T));
#define FLASH_FWD_NAX_INSTANTIATE_DIRECT(tname, T, BD, BQ, BK)                                       \
  template [[host_name("flash_fwd_nax_" #tname "_d" #BD "_q" #BQ "_k" #BK "_r")]] [[kernel]] void \
  flash_fwd_nax<T, BD, BQ, BK, false, true>(FLASH_FWD_ARGS(T));

#define FLASH_FWD_NAX_TILES(tname, T)                  \
  FLASH_FWD_NAX_INSTANTIATE(tname, T, 32, 64, 32)      \
  FLASH_FWD_NAX_INSTANTIATE(tname, T, 32, 64, 64)      \
  FLASH_FWD_NAX_INSTANTIATE(tname, T, 64, 32, 32)      \
  FLASH_FWD_NAX_INSTANTIATE(tname, T, 64, 64, 32)      \
  FLASH_FWD_NAX_INSTANTIATE(tname, T, 64, 128, 32)     \
  FLASH_FWD_NAX_INSTANTIATE(tname, T, 64, 64, 64)      \
  FLASH_FWD_NAX_INSTANTIATE(tname, T, 96, 32, 32)      \
  FLASH_FWD_NAX_INSTANTIATE(tname, T, 96, 64, 32)      \
  FLASH_FWD_NAX_INSTANTIATE(tname, T, 96, 128, 32)     \
  FLASH_FWD_NAX_INSTANTIATE(tname, T, 128, 32, 32)     \
  FLASH_FWD_NAX_INSTANTIATE(tname, T, 128, 64, 32)     \
  FLASH_FWD_NAX_INSTANTIATE(tname, T, 128, 128, 32)    \
  FLASH_FWD_NAX_INSTANTIATE_SHARED(tname, T, 160, 32, 32) \
  FLASH_FWD_NAX_INSTANTIATE_SHARED(tname, T, 160, 64, 32) \
  FLASH_FWD_NAX_INSTANTIATE_SHARED(tname, T, 192, 32, 32) \
  FLASH_FWD_NAX_INSTANTIATE_SHARED(tname, T, 192, 64, 32) \
  FLASH_FWD_NAX_INSTANTIATE_SHARED(tname, T, 256, 32, 32) \
  FLASH_FWD_NAX_INSTANTIATE_SHARED(tname, T, 256, 64, 32) \
  FLASH_FWD_NAX_INSTANTIATE_DIRECT(tname, T, 32, 64, 32) \
  FLASH_FWD_NAX_INSTANTIATE_DIRECT(tname, T, 64, 64, 32) \
  FLASH_FWD_NAX_INSTANTIATE_DIRECT(tname, T, 96, 64, 32) \
  FLASH_FWD_NAX_INSTANTIATE_DIRECT(tname, T, 128, 64, 32) \
  FLASH_FWD_NAX_INSTANTIATE_DIRECT(tname, T, 160, 64, 32) \
  FLASH_FWD_NAX_INSTANTIATE_DIRECT(tname, T, 192, 64, 32) \
  FLASH_FWD_NAX_INSTANTIATE_DIRECT(tname, T, 256, 64, 32)

FLASH_FWD_NAX_TILES(f16, half)
FLASH_FWD_NAX_TILES(bf16, bfloat)
