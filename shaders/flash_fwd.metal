// FlashAttention-2 forward (split-Q) with simdgroup-matrix (8x8) multiplies.
//
// Grid: (ceil(pack * Lq / BQ), Hq / pack, B) threadgroups of (BQ / 8)
// simdgroups.  A threadgroup's rows are the query rows of `pack` query heads
// that share a KV head (pack = 1, or the GQA ratio for short queries such as
// decode, so K/V are read once for the whole group).  Each simdgroup owns 8
// query rows: it keeps Q (pre-scaled) and the O accumulator
// in registers as 8x8 float fragments.  Key/value tiles of BK rows stream
// through threadgroup memory (zero-padded to BD columns and past Lk).  The
// online softmax runs in float32: scores stay in natural units (so that the
// row max, and with it lse, is as exact as the scores, and any finite score,
// even -FLT_MAX from a float mask, takes part), the exponentials are
// exp2((s - max) * log2e); O is rescaled per row through the fragment lane
// layout.  No infinity enters the arithmetic (fast math, Metal's default,
// assumes there is none): invisible scores are -FLT_MAX for the row max and
// a bit in `hidden` that zeroes their probability, so a visible -FLT_MAX
// still takes part, and exponent arguments are clamped before they scale.
//
// Template parameters (compile time, chosen by the planner's tile table):
//   T   element type of q/k/v/o: float, half or bfloat (computed as float)
//   BD  head-dim tile width (>= head_dim and head_dim_v, multiple of 8)
//   BQ  query rows per threadgroup (8 per simdgroup)
//   BK  key rows per step
//   KVS K and V tiles share one threadgroup buffer (V is loaded after the
//       scores are computed; two more barriers per step, half the memory,
//       so twice the keys per step for large head dims / float32)
// Function constants switch the optional features off at compile time.
//
// Buffers: 0 q, 1 k, 2 v, 3 o, 4 lse (float, contiguous (B, Hq, Lq)),
// 5 FlashFwdParams, 6 mask (bytes; bool or float kind), 7 alibi slopes
// (float), 8 sinks (float, (Hq,)), 9 aux (float, contiguous (B, Hq, Lq, A),
// only when gradients are needed; see the epilogue).
#include "flash_common.h"

constant bool has_mask [[function_constant(0)]];
constant int mask_kind [[function_constant(1)]];
constant bool has_alibi [[function_constant(2)]];
constant bool has_sinks [[function_constant(3)]];
constant bool has_softcap [[function_constant(4)]];
constant bool has_band [[function_constant(5)]];
// head_dim == head_dim_v == BD: the tile loaders need no column guard.
constant bool dims_aligned [[function_constant(6)]];
// k and v start on 4-element boundaries with row strides that are multiples
// of 4 elements: full K/V tiles are loaded as 4-element vectors.
constant bool kv_vec_aligned [[function_constant(7)]];
// Write the backward's row state into aux: A = 2 floats per row (m, l), and
// for half/bfloat the float32 output row after them (A = 2 + head_dim_v).
constant bool has_aux [[function_constant(8)]];

#define FLASH_FWD_ARGS(T)                                                   \
  const device T* q [[buffer(0)]], const device T* k [[buffer(1)]],         \
      const device T* v [[buffer(2)]], device T* o [[buffer(3)]],           \
      device float* lse [[buffer(4)]],                                      \
      constant FlashFwdParams& p [[buffer(5)]],                             \
      const device uchar* mask [[buffer(6), function_constant(has_mask)]],  \
      const device float* alibi [[buffer(7), function_constant(has_alibi)]], \
      const device float* sinks [[buffer(8), function_constant(has_sinks)]], \
      device float* aux [[buffer(9), function_constant(has_aux)]],          \
      uint3 tgid [[threadgroup_position_in_grid]],                          \
      uint tid [[thread_index_in_threadgroup]],                             \
      uint sg [[simdgroup_index_in_threadgroup]],                           \
      uint lane [[thread_index_in_simdgroup]]

template <typename T, int BD, int BQ, int BK, bool KVS>
[[kernel]] void flash_fwd(FLASH_FWD_ARGS(T)) {
  constexpr int WM = BQ / 8;             // simdgroups
  constexpr int NT = WM * 32;            // threads
  constexpr int LD = BD + flash::TilePad<T>::value;
  constexpr int TG_ELEMS = (KVS ? 1 : 2) * BK * LD;  // K tile then V tile, or one shared
  constexpr int NF = BD / 8;             // fragments along the head dim
  constexpr int NK = BK / 8;             // fragments along the keys
  static_assert(BQ % 8 == 0 && BK % 8 == 0 && BD % 8 == 0, "tile sizes");
  static_assert(NK <= 16, "one bit per score element of a lane in `hidden`");

  threadgroup T smem[TG_ELEMS];
  threadgroup T* Ks = smem;
  threadgroup T* Vs = KVS ? smem : smem + BK * LD;

  const int b = int(tgid.z);
  const int Lq = p.seqlen_q;
  const int Lk = p.seqlen_k;
  const int pack = p.pack;
  const int rows = pack * Lq;            // packed rows of this head group
  const int h0 = int(tgid.y) * pack;     // first query head of the group
  const int kvh = h0 / p.gqa;
  const int q0 = int(tgid.x) * BQ;       // first packed row of the threadgroup
  const int r0 = q0 + int(sg) * 8;       // first packed row of this simdgroup
  const flash::FragCoord fc = flash::frag_coord(ushort(lane));
  // The row this lane works on: query head h, position i.
  const int my_row = r0 + fc.row;
  const bool row_ok = my_row < rows;
  const int h = h0 + (row_ok ? my_row / Lq : 0);
  const int i = row_ok ? my_row - (h - h0) * Lq : 0;
  // Query positions the threadgroup's rows cover (for block skipping).
  int i_first, i_last;
  flash::packed_row_span(q0, min(q0 + BQ, rows) - 1, Lq, i_first, i_last);

  // Masked scores and the running max of a row that has seen nothing.
  const float kNeg = -FLT_MAX;

  const device T* qrow = q + long(b) * p.q_stride_b + long(h) * p.q_stride_h +
                         long(i) * p.q_stride_l;
  const device T* kp = k + long(b) * p.k_stride_b + long(kvh) * p.k_stride_h;
  const device T* vp = v + long(b) * p.v_stride_b + long(kvh) * p.v_stride_h;

  // Q fragments, pre-scaled (zero past Lq and past head_dim).
  simdgroup_float8x8 Qf[NF];
  for (int dd = 0; dd < NF; ++dd) {
    flash::load_frag_rows(Qf[dd], qrow + dd * 8, row_ok, p.head_dim - dd * 8, fc, p.qk_scale);
  }

  simdgroup_float8x8 Of[NF];
  for (int dd = 0; dd < NF; ++dd) {
    Of[dd] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }

  // Running max m_i of this lane's row (natural units; -FLT_MAX while the
  // row is empty) and the running sum l_i of exp(s - m_i).  A sink is one extra
  // logit with no value: it starts the row at max = sink, sum = 1.
  float m_i = kNeg;
  float l_i = 0.0f;
  if (has_sinks) {
    m_i = sinks[h];
    l_i = 1.0f;
  }

  float slope = 0.0f;
  if (has_alibi) {
    slope = alibi[long(b) * p.a_stride_b + long(h) * p.a_stride_h];
  }

  long mask_row = 0;
  if (has_mask) {
    mask_row = long(b) * p.m_stride_b + long(h) * p.m_stride_h + long(i) * p.m_stride_q;
  }

  // Key blocks that intersect the band of this threadgroup's rows; the
  // others are skipped, not masked.
  const flash::Band band{p.diag_offset, p.window_left, p.window_right};
  int k_lo = 0;
  int k_hi = Lk;
  if (has_band) {
    band.key_range(i_first, i_last, Lk, k_lo, k_hi);
  }
  const int kb_begin = (k_lo / BK) * BK;

  // Plain locals (the tile loader takes them as arguments).
  const bool cols_aligned = dims_aligned;
  const bool vec_ok = kv_vec_aligned;
  for (int kb = kb_begin; kb < k_hi; kb += BK) {
    const int k_valid = Lk - kb;
    flash::load_tile<T, BK, BD, NT>(Ks, LD, kp + long(kb) * p.k_stride_l, p.k_stride_l,
                                    k_valid, p.head_dim, cols_aligned, vec_ok, ushort(tid));
    if (!KVS) {
      flash::load_tile<T, BK, BD, NT>(Vs, LD, vp + long(kb) * p.v_stride_l, p.v_stride_l,
                                      k_valid, p.head_dim_v, cols_aligned, vec_ok, ushort(tid));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Simdgroup-uniform skip: rows past Lq, or rows whose band misses this
    // key block entirely (e.g. the upper part of a causal diagonal block),
    // do no multiply-accumulate work; they still take part in the loads and
    // barriers above and below.
    bool sg_active = r0 < rows;
    bool need_band = false;
    if (has_band && sg_active) {
      int sg_i0, sg_i1, lo, hi;
      flash::packed_row_span(r0, min(r0 + 7, rows - 1), Lq, sg_i0, sg_i1);
      band.key_range(sg_i0, sg_i1, Lk, lo, hi);
      sg_active = kb < hi && kb + BK > lo;
      need_band = !band.block_inside(sg_i0, sg_i1, kb, kb + BK - 1);
    }
    // S = Q K^T for 8 rows x BK keys, then P = exp(S - max) in place.
    simdgroup_float8x8 S[NK];
    uint hidden = 0;  // bit 2 * kk + e: element e of S[kk] is invisible
    if (sg_active) {
      for (int kk = 0; kk < NK; ++kk) {
        S[kk] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (int dd = 0; dd < NF; ++dd) {
          simdgroup_float8x8 Kt;
          flash::load_frag_t(Kt, Ks + kk * 8 * LD + dd * 8, LD, fc);
          simdgroup_multiply_accumulate(S[kk], Qf[dd], Kt, S[kk]);
        }
      }

      // Score transforms and visibility, element-wise on the lane's elements.
      const bool need_bounds = kb + BK > Lk;
      if (has_softcap || has_alibi || has_mask || need_bounds || need_band) {
        for (int kk = 0; kk < NK; ++kk) {
          for (int e = 0; e < 2; ++e) {
            float s = S[kk].thread_elements()[e];
            const int j = kb + kk * 8 + fc.col + e;
            if (has_softcap) s = flash::softcap_tanh(s, p.softcap);
            if (has_alibi) s -= slope * float(abs(i + p.diag_offset - j));
            bool vis = true;
            if (need_bounds) vis = j < Lk;
            if (need_band) vis = vis && band.visible(i, j);
            if (has_mask) {
              if (vis && row_ok) {
                const long off = mask_row + long(j) * p.m_stride_k;
                if (mask_kind == flash::kMaskBool) {
                  vis = mask[off] != 0;
                } else {
                  bool neg_inf;
                  s += flash::read_float_mask(mask, off, int(mask_kind), neg_inf);
                  vis = !neg_inf;
                }
              }
            }
            S[kk].thread_elements()[e] = vis ? s : kNeg;
            hidden |= vis ? 0u : 1u << (2 * kk + e);
          }
        }
      }

      // Online softmax (rows are shared by the 4 lanes xor 1 and xor 8).
      float mx = kNeg;
      for (int kk = 0; kk < NK; ++kk) {
        mx = max(mx, max(S[kk].thread_elements()[0], S[kk].thread_elements()[1]));
      }
      mx = flash::row_max(mx);
      const float m_new = max(m_i, mx);
      const float factor = flash::exp_shifted(m_i - m_new);
      float rs = 0.0f;
      for (int kk = 0; kk < NK; ++kk) {
        const float p0 = (hidden >> (2 * kk)) & 1u ? 0.0f : flash::exp_shifted(S[kk].thread_elements()[0] - m_new);
        const float p1 =
            (hidden >> (2 * kk + 1)) & 1u ? 0.0f : flash::exp_shifted(S[kk].thread_elements()[1] - m_new);
        S[kk].thread_elements()[0] = p0;
        S[kk].thread_elements()[1] = p1;
        rs += p0 + p1;
      }
      rs = flash::row_sum(rs);
      l_i = l_i * factor + rs;
      m_i = m_new;
      for (int dd = 0; dd < NF; ++dd) {
        flash::frag_scale(Of[dd], factor);
      }
    }

    if (KVS) {  // every simdgroup is done with K: bring V into the same buffer
      threadgroup_barrier(mem_flags::mem_threadgroup);
      flash::load_tile<T, BK, BD, NT>(Vs, LD, vp + long(kb) * p.v_stride_l, p.v_stride_l,
                                      k_valid, p.head_dim_v, cols_aligned, vec_ok, ushort(tid));
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // O += P V.
    if (sg_active) {
      for (int kk = 0; kk < NK; ++kk) {
        for (int dd = 0; dd < NF; ++dd) {
          simdgroup_float8x8 Vf;
          flash::load_frag(Vf, Vs + kk * 8 * LD + dd * 8, LD, fc);
          simdgroup_multiply_accumulate(Of[dd], S[kk], Vf, Of[dd]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // Epilogue: O / l in the caller's layout, lse = m + ln(l) (+inf when empty, NaN
  // when a score was: flash::saw_keys).
  const float inv_l = flash::inv_row_sum(l_i);
  device T* orow = o + long(b) * p.o_stride_b + long(h) * p.o_stride_h + long(i) * p.o_stride_l;
  for (int dd = 0; dd < NF; ++dd) {
    flash::store_frag_rows(Of[dd], orow + dd * 8, row_ok, p.head_dim_v - dd * 8, fc, inv_l);
  }
  if (fc.col == 0 && row_ok) {
    flash::store_lse(lse + (long(b) * p.heads + h) * long(Lq) + i, m_i, l_i);
  }
  // The backward's row state: the final max m and sum l, so that it rebuilds
  // P = exp(s - m) / l from the very same scores (exp(s - lse) would carry
  // lse's rounding, ~ulp(|lse|), into every P at large scores), and for
  // fp16/bf16 the output before rounding (delta = rowsum(dO * O) needs it).
  if (has_aux) {
    constexpr bool kAuxOut = flash::AuxHasOut<T>::value;
    const int pitch = kAuxOut ? 2 + p.head_dim_v : 2;
    device float* arow = aux + ((long(b) * p.heads + h) * long(Lq) + i) * pitch;
    if (fc.col == 0 && row_ok) {
      arow[0] = flash::saw_keys(l_i) ? m_i : 0.0f;  // a row that saw nothing: any finite max
      arow[1] = l_i;
    }
    if (kAuxOut) {
      for (int dd = 0; dd < NF; ++dd) {
        flash::store_frag_rows(Of[dd], arow + 2 + dd * 8, row_ok, p.head_dim_v - dd * 8, fc, inv_l);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Instantiations: flash_fwd_<dtype>_d<BD>_q<BQ>_k<BK>[_s], "_s" when K and V
// share one tile buffer.  Every entry of torch_metal_flash/planner/tiles.py
// must appear here (a test checks).
// ---------------------------------------------------------------------------
#define FLASH_FWD_INSTANTIATE(tname, T, BD, BQ, BK)                                   \
  template [[host_name("flash_fwd_" #tname "_d" #BD "_q" #BQ "_k" #BK)]] [[kernel]] void \
  flash_fwd<T, BD, BQ, BK, false>(FLASH_FWD_ARGS(T));
#define FLASH_FWD_INSTANTIATE_SHARED(tname, T, BD, BQ, BK)                                   \
  template [[host_name("flash_fwd_" #tname "_d" #BD "_q" #BQ "_k" #BK "_s")]] [[kernel]] void \
  flash_fwd<T, BD, BQ, BK, true>(FLASH_FWD_ARGS(T));

// float32: separate K and V tiles of BK x (BD + 4) floats up to d64, one
// shared tile above
FLASH_FWD_INSTANTIATE(f32, float, 32, 32, 32)
FLASH_FWD_INSTANTIATE(f32, float, 64, 32, 32)
FLASH_FWD_INSTANTIATE_SHARED(f32, float, 80, 32, 32)
FLASH_FWD_INSTANTIATE_SHARED(f32, float, 96, 32, 32)
FLASH_FWD_INSTANTIATE_SHARED(f32, float, 128, 32, 32)
FLASH_FWD_INSTANTIATE_SHARED(f32, float, 160, 32, 16)
FLASH_FWD_INSTANTIATE_SHARED(f32, float, 192, 32, 16)
FLASH_FWD_INSTANTIATE_SHARED(f32, float, 256, 32, 16)

// float16: BK x (BD + 8) halves, separate K and V up to d128, shared above
FLASH_FWD_INSTANTIATE(f16, half, 32, 32, 64)
FLASH_FWD_INSTANTIATE(f16, half, 64, 32, 64)
FLASH_FWD_INSTANTIATE(f16, half, 80, 32, 32)
FLASH_FWD_INSTANTIATE(f16, half, 96, 32, 32)
FLASH_FWD_INSTANTIATE(f16, half, 128, 32, 32)
FLASH_FWD_INSTANTIATE_SHARED(f16, half, 160, 32, 32)
FLASH_FWD_INSTANTIATE_SHARED(f16, half, 192, 32, 32)
FLASH_FWD_INSTANTIATE_SHARED(f16, half, 256, 32, 32)

// bfloat16 (loaded and computed as float), same tiles as float16
FLASH_FWD_INSTANTIATE(bf16, bfloat, 32, 32, 64)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 64, 32, 64)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 80, 32, 32)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 96, 32, 32)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 128, 32, 32)
FLASH_FWD_INSTANTIATE_SHARED(bf16, bfloat, 160, 32, 32)
FLASH_FWD_INSTANTIATE_SHARED(bf16, bfloat, 192, 32, 32)
FLASH_FWD_INSTANTIATE_SHARED(bf16, bfloat, 256, 32, 32)
