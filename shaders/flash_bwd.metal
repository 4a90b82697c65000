// FlashAttention-2 backward: deterministic (no atomics), recomputing the
// probabilities from the forward's row state, with simdgroup-matrix (8x8)
// multiplies and float32 accumulation.  Gradients are written in the input dtype.
//
// P is rebuilt exactly: the scores are computed by the forward's own code (q
// pre-scaled by FlashFwdParams::qk_scale, flash::qk_block's multiply-accumulate
// chain over the head dim -- the dK/dV kernel runs it transposed, in the same
// order -- and flash::transform_score), so they equal the forward's bit for
// bit, and P = exp(s - m) / l
// with the forward's own row max m and sum l (its aux output).  A row whose
// single key is visible gets P = 1 exactly, and large scores lose nothing to
// the rounding of lse = m + ln(l).
//
// Kernels (in launch order, see torch_metal_flash/planner/backward.py):
//
//  1. flash_bwd_pre_<dt>: one simdgroup per query row (B*Hq*Lq rows):
//       delta[r] = rowsum(dO * O) - dlse[r]         (float32 scratch)
//       stats[r] = (m, 1 / l) from aux, or (0, 0) for rows that pass no
//     gradient (nothing visible: l = 0; saturated: m < -1e37).  O is the
//     float32 output row from aux for fp16/bf16 (flash::AuxHasOut), not the
//     output rounded to the input dtype.
//  2. flash_bwd_dq_<dt>_d<BD>_q<BQ>_k<BK>: grid (ceil(Lq/BQ), Hq, B), one
//     simdgroup per 8 query rows; Q (pre-scaled), dO and the dQ accumulator
//     live in registers; K and V tiles of BK rows stream through threadgroup
//     memory.  Per key block: S = Q K^T, P = exp(S - m) / l, dP = dO V^T,
//     dS = P (dP - delta) (written to dbias when asked), softcap chain rule,
//     dQ += scale * dS K.  Also writes the zeros of dbias outside the band.
//     `_ds<DS>` (head dims 384, 512): DS simdgroups per 8 rows, each holding
//     a slice of Q, dO and dQ; their partial S and dP meet in threadgroup
//     memory (flash::slice_sum) and every slice computes the same dS (the
//     first one writes dbias).
//  3. flash_bwd_dkv_<dt>_d<BD>_k<BK>_q<BQ>_m<MODE>: grid (ceil(Lk/BK), Hkv, B),
//     one simdgroup per 8 key rows, the dK / dV accumulators in registers;
//     loops over every query head of the GQA group and over the query blocks
//     of the band, streaming Q and dO tiles (and their stats / delta) through
//     threadgroup memory (Q pre-scaled as its fragments load).  Every dK / dV
//     row has exactly one writer.  MODE 0 computes dK and dV (K and V in
//     registers up to head dim 64, staged once in threadgroup memory above),
//     MODE 1 only dK, MODE 2 only dV (a split pair, K and V in registers: a
//     tuning variant, float32's default at head dim 512).  `_ds<DS>` (head dims
//     384, 512): DS simdgroups per 8 key rows, each holding a slice of K, V,
//     dK and dV in registers, partial S^T and dP^T summed as in the dQ kernel.
//  4. flash_bwd_dsinks: one threadgroup per head, a fixed-order reduction
//     dsinks[h] = -sum_{b,i} exp(sink[h] - m[b,h,i]) / l[b,h,i] * delta[b,h,i].
//  5. flash_bwd_diag_<dt>_d<BD>_q<BQ>_k<BK> (FlexAttention sources only): the
//     gradient sums of captured tensors read at q - kv, one threadgroup per
//     block of diagonals (flash_flex.h); the dQ and dK/dV kernels sum the reads
//     along rows and columns.
//  6. flash_bwd_segment_sum (FlexAttention sources only): those sums added per index
//     of the captured tensor.
//
// Element (row i, key j) of the score (the forward's definition):
//   x = scale * q.k; x = cap * tanh(x / cap); x -= slope |i + diag - j|;
//   x += bias[i, j]; visible iff band and bool mask.
//
// Varlen (is_varlen, has_seqused_k, as in flash_fwd.metal): grid entry z is a
// sequence (flash::seq_of); the dQ kernel covers max_seqlen_q rows, the dK/dV
// kernel max_seqlen_k key rows of each
// sequence, threadgroups past a sequence's rows return at once, and dK/dV rows
// of keys past seqused_k are written as zeros.  The preprocess and dsinks
// kernels run over the tensors' rows as they are.  Dropout (has_dropout):
// the forward's Philox mask is regenerated per element (flash::Dropout): with
// Z = keep / (1 - p), dP = (dO V^T) Z, dS = P (dP - delta), dV += (P Z)^T dO
// (delta = rowsum(dO * O) of the dropped output O).
//
// Function constants (indices: function_constants.h): the forward's FC_ATTN_*
// ones, which the scores depend on, plus has_dbias and has_dlse.
// Threadgroup memory per variant: planner/backward_tiles.py and
// bench/results/backward.md.
#include "flash_common.h"
#include "flash_bwd_params.h"
#include "flash_flex.h"
#include "function_constants.h"

constant bool has_mask [[function_constant(FC_ATTN_HAS_MASK)]];
constant int mask_kind [[function_constant(FC_ATTN_MASK_KIND)]];
constant bool has_alibi [[function_constant(FC_ATTN_HAS_ALIBI)]];
constant bool has_sinks [[function_constant(FC_ATTN_HAS_SINKS)]];
constant bool has_softcap [[function_constant(FC_ATTN_HAS_SOFTCAP)]];
constant bool has_band [[function_constant(FC_ATTN_HAS_BAND)]];
// head_dim == head_dim_v == BD: the tile loaders need no column guard.
constant bool dims_aligned [[function_constant(FC_ATTN_DIMS_ALIGNED)]];
constant bool has_dbias [[function_constant(FC_BWD_HAS_DBIAS)]];
constant bool has_dlse [[function_constant(FC_BWD_HAS_DLSE)]];
constant bool is_varlen [[function_constant(FC_ATTN_IS_VARLEN)]];
constant bool has_seqused_k [[function_constant(FC_ATTN_HAS_SEQUSED_K)]];
constant bool has_dropout [[function_constant(FC_ATTN_HAS_DROPOUT)]];

namespace flash_bwd {

// A row's max below this marks a saturated row (see the preprocess kernel).
constant constexpr float kSaturated = -1.0e37f;
// Up to this head dim the fused dK/dV kernel holds K and V in registers
// (planner/backward_tiles.py: REGISTER_KV_MAX_BD).
constant constexpr int kRegisterKVMaxBD = 64;

// dP = dO V^T for a block of NK * 8 keys: two chains (even / odd head-dim
// fragments) summed at the end, half the rounding-error growth of one chain over BD.
template <typename T, int NF, int NK, int LD>
inline void dp_block(thread simdgroup_float8x8* dP, const thread simdgroup_float8x8* dOf, const threadgroup T* Vs,
                     flash::FragCoord fc) {
  for (int kk = 0; kk < NK; ++kk) {
    simdgroup_float8x8 p1 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    dP[kk] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int dd = 0; dd < NF; dd += 2) {
      simdgroup_float8x8 Vt;
      flash::load_frag_t(Vt, Vs + kk * 8 * LD + dd * 8, LD, fc);
      simdgroup_multiply_accumulate(dP[kk], dOf[dd], Vt, dP[kk]);
      flash::load_frag_t(Vt, Vs + kk * 8 * LD + dd * 8 + 8, LD, fc);
      simdgroup_multiply_accumulate(p1, dOf[dd + 1], Vt, p1);
    }
    flash::frag_add(dP[kk], p1);
  }
}

// Fragment dd of a simdgroup's 8 K (or V) rows: held in registers, or read from
// the rows staged in threadgroup memory.
template <bool STAGED, typename T>
inline simdgroup_float8x8 row_frag(const thread simdgroup_float8x8* regs, const threadgroup T* rows, int ld, int dd,
                                   flash::FragCoord fc) {
  if (!STAGED) return regs[dd];
  simdgroup_float8x8 m;
  flash::load_frag(m, rows + dd * 8, ld, fc);
  return m;
}

// P = exp(s - m) / l of a visible score with the row's stats (m, 1 / l).
// s <= m for the forward's own scores; the clamp keeps the exponent finite
// for any finite score (a finfo.min mask) and for rows with stats (0, 0).
inline float prob(float s, float2 st) {
  return exp2(clamp(s - st.x, -128.0f, 0.0f) * flash::kLog2e) * st.y;
}

}  // namespace flash_bwd

// ---------------------------------------------------------------------------
// 1. Preprocess: delta = rowsum(dO * O) - dlse, stats = (m, 1 / l).
// ---------------------------------------------------------------------------
#define FLASH_BWD_PRE_ARGS(T)                                                  \
  const device T* dout [[buffer(0)]], const device T* out [[buffer(1)]],       \
      const device float* aux [[buffer(2)]],                                   \
      const device float* dlse [[buffer(3), function_constant(has_dlse)]],     \
      device float* delta [[buffer(4)]], device float2* stats [[buffer(5)]],   \
      constant FlashBwdParams& p [[buffer(6)]],                                \
      uint3 tgid [[threadgroup_position_in_grid]],                             \
      ushort sg [[simdgroup_index_in_threadgroup]],                            \
      ushort lane [[thread_index_in_simdgroup]]

constant constexpr int kPreRowsPerGroup = 8;  // simdgroups (rows) per threadgroup

template <typename T>
[[kernel]] void flash_bwd_pre(FLASH_BWD_PRE_ARGS(T)) {
  const int row = int(tgid.x) * kPreRowsPerGroup + int(sg);
  if (row >= p.rows) return;  // uniform over the simdgroup
  const int Lq = p.f.seqlen_q;
  const int i = row % Lq;
  const int bh = row / Lq;
  const int h = bh % p.f.heads;
  const int b = bh / p.f.heads;
  const device T* dop = dout + long(b) * p.do_stride_b + long(h) * p.do_stride_h + long(i) * p.do_stride_l;
  const device T* op = out + long(b) * p.f.o_stride_b + long(h) * p.f.o_stride_h + long(i) * p.f.o_stride_l;
  constexpr bool kAuxOut = flash::AuxHasOut<T>::value;
  const int pitch = kAuxOut ? 2 + p.f.head_dim_v : 2;
  const device float* arow = aux + long(row) * pitch;
  float acc = 0.0f;
  for (int d = lane; d < p.f.head_dim_v; d += 32) {
    const float o = kAuxOut ? arow[2 + d] : float(op[d]);
    acc += float(dop[d]) * o;
  }
  acc = simd_sum(acc);
  if (lane == 0) {
    float dd = acc;
    if (has_dlse) dd -= dlse[row];
    delta[row] = dd;
    const float m = arow[0];
    const float l = arow[1];
    // A row that saw nothing (l = 0), or whose every score is below -1e37 (a
    // float mask of finfo.min on all keys: padding rows; it is locally
    // constant in q and k), passes no gradient (reference.SATURATED_LSE is
    // the same rule).  Both are finite here: the forward writes m = 0 for l = 0.
    const bool live = l > 0.0f && m > flash_bwd::kSaturated;
    const float inv_l = 1.0f / (live ? l : 1.0f);  // never 1 / 0
    stats[row] = live ? float2(m, inv_l) : float2(0.0f, 0.0f);
  }
}

// The varlen index vectors and the dropout state, bound to the dQ and dK/dV kernels.
#define FLASH_BWD_VARLEN_ARGS                                                    \
  const device int* cu_q [[buffer(11), function_constant(is_varlen)]],           \
      const device int* cu_k [[buffer(12), function_constant(is_varlen)]],       \
      const device int* seqused [[buffer(13), function_constant(has_seqused_k)]], \
      const device long* rng [[buffer(14), function_constant(has_dropout)]],     \
      FLEX_KERNEL_PARAMS

// ---------------------------------------------------------------------------
// 2. dQ (and dbias).
// ---------------------------------------------------------------------------
#define FLASH_BWD_DQ_ARGS(T)                                                     \
  const device T* q [[buffer(0)]], const device T* k [[buffer(1)]],              \
      const device T* v [[buffer(2)]], const device T* dout [[buffer(3)]],       \
      const device float2* stats [[buffer(4)]], const device float* delta [[buffer(5)]], \
      constant FlashBwdParams& p [[buffer(6)]],                                  \
      const device uchar* mask [[buffer(7), function_constant(has_mask)]],       \
      const device float* alibi [[buffer(8), function_constant(has_alibi)]],     \
      device T* dq [[buffer(9)]],                                                \
      device float* dbias [[buffer(10), function_constant(has_dbias)]],          \
      FLASH_BWD_VARLEN_ARGS FLEX_GRAD_PARAMS                                     \
      uint3 tgid [[threadgroup_position_in_grid]],                               \
      ushort tid [[thread_index_in_threadgroup]],                                \
      ushort sg [[simdgroup_index_in_threadgroup]],                              \
      ushort lane [[thread_index_in_simdgroup]]

template <typename T, int BD, int BQ, int BK, int DS>
[[kernel]] void flash_bwd_dq(FLASH_BWD_DQ_ARGS(T)) {
  constexpr int WM = BQ / 8 * DS;  // simdgroups: DS per 8 rows
  constexpr int NT = WM * 32;
  constexpr int LD = flash::TileLD<T, BD, 2 * BK>::value;
  constexpr int NF = BD / 8 / DS;  // fragments along the head dim a simdgroup holds
  constexpr int NK = BK / 8;
  // (DS > 1) per row group: the slices' partial S, then their partial dP
  constexpr int AREA = DS > 1 ? 2 * DS * NK * 64 : 0;
  static_assert(BQ % 8 == 0 && BK % 8 == 0 && (BD / DS) % 16 == 0, "tile sizes (two chains over BD)");
  static_assert(DS == 1 || DS == flash::ScoreSlices<BD>::value, "a head-dim split has the scores' slices");

  threadgroup T smem[2 * BK * LD + AREA * BQ / 8 * int(sizeof(float) / sizeof(T))];
  threadgroup T* Ks = smem;
  threadgroup T* Vs = smem + BK * LD;

  constant FlashFwdParams& f = p.f;
  const bool aligned = dims_aligned;  // (a plain bool argument below)
  const int b = int(tgid.z);
  const flash::Seq sq = flash::seq_of(f, b, is_varlen, false, has_seqused_k, cu_q, cu_k, seqused);
  const int h = int(tgid.y);
  const int kvh = h / f.gqa;
  const int Lq = sq.lq;
  const int Lk = sq.lk;
  const int q0 = int(tgid.x) * BQ;
  if (q0 >= Lq) return;  // past this sequence's rows (varlen); all threads alike
  // Head-dim split: simdgroup sg holds columns slice * NF * 8.. of its row group's 8 rows.
  const int slice = int(sg) % DS;
  const int col0 = slice * NF * 8;
  threadgroup float* area = reinterpret_cast<threadgroup float*>(smem + 2 * BK * LD) + int(sg) / DS * AREA;
  const int r0 = q0 + int(sg) / DS * 8;
  const flash::FragCoord fc = flash::frag_coord(lane);
  const int my_row = r0 + fc.row;
  const bool row_ok = my_row < Lq;
  const int i_last = min(q0 + BQ, Lq) - 1;

  const long row0 = long(sq.q0 + r0);  // the simdgroup's first row in the tensors
  const device T* qp = q + long(sq.bt) * f.q_stride_b + long(h) * f.q_stride_h + row0 * f.q_stride_l + col0;
  const device T* dop = dout + long(sq.bt) * p.do_stride_b + long(h) * p.do_stride_h + row0 * p.do_stride_l + col0;
  const device T* kp = k + long(sq.bt) * f.k_stride_b + long(kvh) * f.k_stride_h + long(sq.k0) * f.k_stride_l;
  const device T* vp = v + long(sq.bt) * f.v_stride_b + long(kvh) * f.v_stride_h + long(sq.k0) * f.v_stride_l;

  simdgroup_float8x8 Qf[NF];
  simdgroup_float8x8 dOf[NF];
  simdgroup_float8x8 dQf[NF];
  for (int dd = 0; dd < NF; ++dd) {
    flash::load_frag_device(Qf[dd], qp + dd * 8, f.q_stride_l, Lq - r0, f.head_dim - col0 - dd * 8, fc,
                            f.qk_scale);
    flash::load_frag_device(dOf[dd], dop + dd * 8, p.do_stride_l, Lq - r0, f.head_dim_v - col0 - dd * 8, fc,
                            1.0f);
    dQf[dd] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }

  const long row_idx = (long(sq.bt) * f.heads + h) * long(f.seqlen_q) + sq.q0 + my_row;
  const float2 my_stats = row_ok ? stats[row_idx] : float2(0.0f, 0.0f);
  const float my_delta = row_ok ? delta[row_idx] : 0.0f;
  flash::Dropout drop{};
  if (has_dropout) drop = flash::dropout_of(rng, b, f.heads, h, f.dropout_threshold);

  float slope = 0.0f;
  if (has_alibi) slope = alibi[long(b) * f.a_stride_b + long(h) * f.a_stride_h];
  long mask_row = 0;
  if (has_mask) mask_row = long(b) * f.m_stride_b + long(h) * f.m_stride_h + long(my_row) * f.m_stride_q;
  device float* db_row = nullptr;
  if (has_dbias) {
    db_row = dbias + long(b) * p.db_stride_b + long(h) * p.db_stride_h + long(my_row) * p.db_stride_q;
  }

  const flash::Band band{sq.diag, f.window_left, f.window_right};
  const flash::ScoreFeatures feat{has_softcap, has_alibi, has_mask, mask_kind};
  int k_lo = 0;
  int k_hi = Lk;
  if (has_band) band.key_range(q0, i_last, Lk, k_lo, k_hi);
  const int kb_begin = (k_lo / BK) * BK;
  int kb_end = kb_begin;
  // The key blocks: the band's range, or (FlexAttention) the BlockMask's lists.
  const flash::InnerSteps steps = kFlex ? flash::flex_steps(FLEX_LISTS, b, h, q0, BK, Lk)
                                        : flash::InnerSteps::range(kb_begin, k_hi, BK);
  const flex::Captured cap = FLEX_CAPTURED;
  float row_acc[flash::kFlexRowSlots];  // (FlexAttention) the row sums of the reads' gradients
  for (int r = 0; r < flash::kFlexRowSlots; ++r) row_acc[r] = 0.0f;

  constexpr int CH = BK < flash::kFlexChunk ? BK : flash::kFlexChunk;  // (FlexAttention) load chunks
  constexpr uint kAllChunks = (1u << (BK / CH)) - 1u;
  for (int t = 0; t < steps.count; ++t) {
    uint word;
    const int kb = steps.at(t, word);
    if (kFlex && (kb < 0 || kb >= Lk)) continue;  // uniform: past the keys of a last, partial block
    // (FlexAttention) the chunks of keys some sub-block of these rows sees; none: skip the step
    const uint chunks = kFlex ? steps.sub.chunks<CH, BK / CH>(word, q0, i_last, kb) : kAllChunks;
    if (chunks == 0) continue;  // uniform
    kb_end = kb + BK;
    const int k_valid = Lk - kb;
    flash::load_tile_chunks<T, BK, BD, NT, CH>(Ks, LD, kp + long(kb) * f.k_stride_l, f.k_stride_l, k_valid,
                                               f.head_dim, aligned, tid, chunks);
    flash::load_tile_chunks<T, BK, BD, NT, CH>(Vs, LD, vp + long(kb) * f.v_stride_l, f.v_stride_l, k_valid,
                                               f.head_dim_v, aligned, tid, chunks);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const int sg_last = min(r0 + 7, Lq - 1);
    bool sg_active = r0 < Lq;
    bool need_band = false;
    if (has_band && sg_active) {
      int lo, hi;
      band.key_range(r0, sg_last, Lk, lo, hi);
      sg_active = kb < hi && kb + BK > lo;
      need_band = !band.block_inside(r0, sg_last, kb, kb + BK - 1);
    }
    simdgroup_float8x8 S[NK];
    simdgroup_float8x8 dP[NK];
    if (sg_active) {
      // S: the forward's scores bit for bit (the same chains: flash::qk_share).
      flash::qk_share<DS, NF, NK, LD>(S, Qf, Ks, slice, fc);
      flash_bwd::dp_block<T, NF, NK, LD>(dP, dOf, Vs + col0, fc);
    }
    // (DS > 1) the slices' S and dP summed; every simdgroup reaches the barrier
    if (DS > 1) flash::slice_sum<DS, NK, true>(S, dP, area, slice, sg_active, fc);
    if (sg_active) {
      // dS, element-wise (kept in S; every slice alike, the first one writes dbias).
      const bool need_bounds = kb + BK > Lk;
      for (int kk = 0; kk < NK; ++kk) {
        float zs[2] = {1.0f, 1.0f};  // dropout: keep / (1 - p)
        if (has_dropout) {
          bool keep0, keep1;
          drop.keep2(my_row, kb + kk * 8 + fc.col, keep0, keep1);
          zs[0] = keep0 ? f.dropout_scale : 0.0f;
          zs[1] = keep1 ? f.dropout_scale : 0.0f;
        }
        for (int e = 0; e < 2; ++e) {
          const int j = kb + kk * 8 + fc.col + e;
          bool vis = row_ok;
          if (need_bounds) vis = vis && j < Lk;
          if (need_band) vis = vis && band.visible(my_row, j);
          const flash::Score sc =
              flash::transform_score(S[kk].thread_elements()[e], my_row, j, sq.diag, slope, f.softcap, feat, mask,
                                     mask_row + long(j) * f.m_stride_k, row_ok, vis);
          float s = sc.s;
          float grad = 1.0f;  // d score / d x of the flex score_mod
          if (kFlex) {
            s = flash::flex_score<true>(s, b, h, my_row, j, steps.sub.state(word, my_row, j), cap, vis, grad);
          }
          float ds = 0.0f;
          if (vis) {
            const float pr = flash_bwd::prob(s, my_stats);
            ds = pr * (dP[kk].thread_elements()[e] * zs[e] - my_delta);
            flash::flex_line_grads<0>(row_acc, ds, sc.s, b, h, my_row, j, cap);
          }
          if (has_dbias && row_ok && j < Lk && slice == 0) db_row[j] = ds;
          if (has_softcap) ds *= 1.0f - sc.th * sc.th;
          if (kFlex) ds *= grad;
          S[kk].thread_elements()[e] = ds * p.scale;
        }
      }
      // dQ += dS K: the block's product in a fresh fragment, then one add
      // (a rounding chain of NK*8 + blocks instead of every key of the row).
      for (int dd = 0; dd < NF; ++dd) {
        simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (int kk = 0; kk < NK; ++kk) {
          simdgroup_float8x8 Kf;
          flash::load_frag(Kf, Ks + kk * 8 * LD + col0 + dd * 8, LD, fc);
          simdgroup_multiply_accumulate(acc, S[kk], Kf, acc);
        }
        flash::frag_add(dQf[dd], acc);
      }
    } else if (has_dbias && row_ok && slice == 0) {
      for (int kk = 0; kk < NK; ++kk) {
        for (int e = 0; e < 2; ++e) {
          const int j = kb + kk * 8 + fc.col + e;
          if (j < Lk) db_row[j] = 0.0f;
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // dbias is zero outside the key blocks the band touches.
  if (has_dbias && slice == 0) {
    const int hi_start = min(kb_end, Lk);
    for (int rr = 0; rr < 8; ++rr) {
      const int i = r0 + rr;
      if (i >= Lq) break;
      device float* drow = dbias + long(b) * p.db_stride_b + long(h) * p.db_stride_h + long(i) * p.db_stride_q;
      for (int j = lane; j < kb_begin && j < Lk; j += 32) drow[j] = 0.0f;
      for (int j = hi_start + lane; j < Lk; j += 32) drow[j] = 0.0f;
    }
  }

  flash::flex_store_lines<0>(FLEX_GRADS, row_acc, b, h, my_row, row_ok && slice == 0, fc, f, cap);

  device T* dqp = dq + long(sq.bt) * p.dq_stride_b + long(h) * p.dq_stride_h + row0 * p.dq_stride_l + col0;
  for (int dd = 0; dd < NF; ++dd) {
    flash::store_frag_device(dQf[dd], dqp + dd * 8, p.dq_stride_l, Lq - r0, f.head_dim - col0 - dd * 8, fc, 1.0f);
  }
}

// ---------------------------------------------------------------------------
// 3. dK and dV.
// ---------------------------------------------------------------------------
#define FLASH_BWD_DKV_ARGS(T)                                                    \
  const device T* q [[buffer(0)]], const device T* k [[buffer(1)]],              \
      const device T* v [[buffer(2)]], const device T* dout [[buffer(3)]],       \
      const device float2* stats [[buffer(4)]], const device float* delta [[buffer(5)]], \
      constant FlashBwdParams& p [[buffer(6)]],                                  \
      const device uchar* mask [[buffer(7), function_constant(has_mask)]],       \
      const device float* alibi [[buffer(8), function_constant(has_alibi)]],     \
      device T* dk [[buffer(9)]], device T* dv [[buffer(10)]],                   \
      FLASH_BWD_VARLEN_ARGS FLEX_GRAD_PARAMS                                     \
      uint3 tgid [[threadgroup_position_in_grid]],                               \
      ushort tid [[thread_index_in_threadgroup]],                                \
      ushort sg [[simdgroup_index_in_threadgroup]],                              \
      ushort lane [[thread_index_in_simdgroup]]

template <typename T, int BD, int BK, int BQ, int MODE, int DS>
[[kernel]] void flash_bwd_dkv(FLASH_BWD_DKV_ARGS(T)) {
  constexpr int WM = BK / 8 * DS;  // simdgroups: DS per 8 key rows
  constexpr int NT = WM * 32;
  constexpr int NF = BD / 8 / DS;  // fragments along the head dim a simdgroup holds
  constexpr int NQ = BQ / 8;
  constexpr bool kDK = MODE != 2;
  constexpr bool kDV = MODE != 1;
  // The undivided fused kernel above head dim 64 keeps only the dK and dV
  // accumulators in registers: its K and V rows wait in threadgroup memory (read
  // as fragments per query block), which keeps one kernel -- S and dP computed
  // once -- within a thread's registers up to head dim 256.  A head-dim split
  // holds its slices of K and V in registers.
  constexpr bool kStageKV = MODE == 0 && BD > flash_bwd::kRegisterKVMaxBD && DS == 1;
  constexpr int KV_ROWS = kStageKV ? 2 * BK : 0;
  constexpr int LD = flash::TileLD<T, BD, 2 * BQ + KV_ROWS>::value;
  constexpr int TILE_ELEMS = (2 * BQ + KV_ROWS) * LD;
  // (DS > 1) per row group: the slices' partial S^T, then their partial dP^T
  constexpr int AREA = DS > 1 ? 2 * DS * NQ * 64 : 0;
  constexpr int AREA_ELEMS = AREA * BK / 8 * int(sizeof(float) / sizeof(T));
  // The block's row statistics are staged in threadgroup memory where they fit
  // next to the tiles, else read from device memory where used.
  constexpr bool kStatsStaged = (TILE_ELEMS + AREA_ELEMS) * int(sizeof(T)) + BQ * 12 <= flash::kThreadgroupBytes;
  static_assert(BQ % 8 == 0 && BK % 8 == 0 && (BD / DS) % 16 == 0, "tile sizes (two chains over BD)");
  static_assert(DS == 1 || DS == flash::ScoreSlices<BD>::value, "a head-dim split has the scores' slices");

  // One buffer: the Q and dO tiles, the staged K and V rows, the split's exchange
  // area, then (when staged) the row statistics m, 1/l and delta.
  constexpr int STAT_ELEMS = kStatsStaged ? BQ * 12 / int(sizeof(T)) : 0;
  threadgroup T smem[TILE_ELEMS + AREA_ELEMS + STAT_ELEMS];
  threadgroup float2* stat_tile = reinterpret_cast<threadgroup float2*>(smem + TILE_ELEMS + AREA_ELEMS);
  threadgroup float* delta_tile = reinterpret_cast<threadgroup float*>(stat_tile + BQ);
  threadgroup T* Qs = smem;
  threadgroup T* dOs = smem + BQ * LD;
  threadgroup T* Ks = smem + 2 * BQ * LD;  // (kStageKV) BK key rows, then BK value rows
  threadgroup T* Vs = Ks + BK * LD;

  constant FlashFwdParams& f = p.f;
  const bool aligned = dims_aligned;  // (a plain bool argument below)
  const int b = int(tgid.z);
  const flash::Seq sq = flash::seq_of(f, b, is_varlen, false, has_seqused_k, cu_q, cu_k, seqused);
  const int kvh = int(tgid.y);
  const int Lq = sq.lq;
  const int Lk = sq.lk;
  const int kb0 = int(tgid.x) * BK;
  // Past this sequence's key rows (varlen); key rows in [lk, lk_rows) get zero gradients.
  if (kb0 >= sq.lk_rows) return;
  // Head-dim split: simdgroup sg holds columns slice * NF * 8.. of its row group's 8 key rows.
  const int slice = int(sg) % DS;
  const int col0 = slice * NF * 8;
  threadgroup float* area = reinterpret_cast<threadgroup float*>(smem + TILE_ELEMS) + int(sg) / DS * AREA;
  const int c0 = kb0 + int(sg) / DS * 8;  // first key row of this simdgroup
  const flash::FragCoord fc = flash::frag_coord(lane);
  const int my_key = c0 + fc.row;
  const bool key_ok = my_key < Lk;

  const long key0 = long(sq.k0 + c0);  // the simdgroup's first key row in the tensors
  const device T* kp = k + long(sq.bt) * f.k_stride_b + long(kvh) * f.k_stride_h + key0 * f.k_stride_l + col0;
  const device T* vp = v + long(sq.bt) * f.v_stride_b + long(kvh) * f.v_stride_h + key0 * f.v_stride_l + col0;

  constexpr int NR = kStageKV ? 1 : NF;  // K and V fragments held in registers
  simdgroup_float8x8 Kf[NR];
  simdgroup_float8x8 Vf[NR];
  simdgroup_float8x8 dKf[NF];
  simdgroup_float8x8 dVf[NF];
  if (kStageKV) {
    const long krow0 = long(sq.k0 + kb0);  // the threadgroup's first key row in the tensors
    const device T* kblk = k + long(sq.bt) * f.k_stride_b + long(kvh) * f.k_stride_h + krow0 * f.k_stride_l;
    const device T* vblk = v + long(sq.bt) * f.v_stride_b + long(kvh) * f.v_stride_h + krow0 * f.v_stride_l;
    flash::load_tile<T, BK, BD, NT>(Ks, LD, kblk, f.k_stride_l, Lk - kb0, f.head_dim, aligned, false, tid);
    flash::load_tile<T, BK, BD, NT>(Vs, LD, vblk, f.v_stride_l, Lk - kb0, f.head_dim_v, aligned, false, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (int dd = 0; dd < NF; ++dd) {
    if (!kStageKV) {
      flash::load_frag_device(Kf[dd], kp + dd * 8, f.k_stride_l, Lk - c0, f.head_dim - col0 - dd * 8, fc, 1.0f);
      if (kDK) {
        flash::load_frag_device(Vf[dd], vp + dd * 8, f.v_stride_l, Lk - c0, f.head_dim_v - col0 - dd * 8, fc, 1.0f);
      }
    }
    if (kDK) dKf[dd] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    if (kDV) dVf[dd] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  const threadgroup T* Ksg = Ks + int(sg) * 8 * LD;  // (kStageKV) this simdgroup's rows
  const threadgroup T* Vsg = Vs + int(sg) * 8 * LD;
  const threadgroup T* Qsl = Qs + col0;  // this simdgroup's columns of the streamed tiles
  const threadgroup T* dOsl = dOs + col0;

  // Query rows whose band reaches this threadgroup's keys, and this simdgroup's.
  const flash::Band band{sq.diag, f.window_left, f.window_right};
  const flash::ScoreFeatures feat{has_softcap, has_alibi, has_mask, mask_kind};
  const int kb_last = min(kb0 + BK, Lk) - 1;
  int q_lo = 0;
  int q_hi = kb0 < Lk ? Lq : 0;  // keys past seqused_k see no query
  if (has_band) flash::query_range(band, kb0, kb_last, Lq, q_lo, q_hi);
  const int qb_begin = (q_lo / BQ) * BQ;
  const int sg_klast = min(c0 + 7, Lk - 1);
  int sq_lo = 0;
  int sq_hi = Lq;
  if (has_band && c0 < Lk) flash::query_range(band, c0, sg_klast, Lq, sq_lo, sq_hi);

  for (int g = 0; g < f.gqa; ++g) {
    const int h = kvh * f.gqa + g;
    const device T* qp = q + long(sq.bt) * f.q_stride_b + long(h) * f.q_stride_h + long(sq.q0) * f.q_stride_l;
    const device T* dop = dout + long(sq.bt) * p.do_stride_b + long(h) * p.do_stride_h + long(sq.q0) * p.do_stride_l;
    const long stat_base = (long(sq.bt) * f.heads + h) * long(f.seqlen_q) + sq.q0;
    flash::Dropout drop{};
    if (has_dropout) drop = flash::dropout_of(rng, b, f.heads, h, f.dropout_threshold);
    float slope = 0.0f;
    if (has_alibi) slope = alibi[long(b) * f.a_stride_b + long(h) * f.a_stride_h];
    long mask_base = 0;
    if (has_mask) mask_base = long(b) * f.m_stride_b + long(h) * f.m_stride_h + long(my_key) * f.m_stride_k;
    // The query blocks: the band's range, or (FlexAttention) the BlockMask's lists of this key block.
    const flash::InnerSteps steps = kFlex ? flash::flex_steps(FLEX_LISTS, b, h, kb0, BQ, Lq)
                                          : flash::InnerSteps::range(qb_begin, q_hi, BQ);
    const flex::Captured cap = FLEX_CAPTURED;
    constexpr int CH = BQ < flash::kFlexChunk ? BQ : flash::kFlexChunk;  // (FlexAttention) load chunks
    constexpr uint kAllChunks = (1u << (BQ / CH)) - 1u;
    float col_acc[flash::kFlexColSlots];  // (FlexAttention) this head's column sums of the reads' gradients
    for (int r = 0; r < flash::kFlexColSlots; ++r) col_acc[r] = 0.0f;

    for (int t = 0; t < steps.count; ++t) {
      uint word;
      const int qb = steps.at(t, word);
      if (kFlex && (qb < 0 || qb >= Lq)) continue;  // uniform: past the rows of a last, partial block
      // (FlexAttention) the chunks of queries some sub-block of these keys sees; none: skip the step
      const uint chunks = kFlex ? steps.sub.chunks<CH, BQ / CH>(word, kb0, kb_last, qb) : kAllChunks;
      if (chunks == 0) continue;  // uniform
      const int q_valid = Lq - qb;
      flash::load_tile_chunks<T, BQ, BD, NT, CH>(Qs, LD, qp + long(qb) * f.q_stride_l, f.q_stride_l, q_valid,
                                                 f.head_dim, aligned, tid, chunks);
      flash::load_tile_chunks<T, BQ, BD, NT, CH>(dOs, LD, dop + long(qb) * p.do_stride_l, p.do_stride_l, q_valid,
                                                 f.head_dim_v, aligned, tid, chunks);
      for (int t = tid; kStatsStaged && t < BQ; t += NT) {
        const bool ok = qb + t < Lq && ((chunks >> (t / CH)) & 1u);
        stat_tile[t] = ok ? stats[stat_base + qb + t] : float2(0.0f, 0.0f);
        delta_tile[t] = ok ? delta[stat_base + qb + t] : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      bool sg_active = c0 < Lk;
      bool need_band = false;
      if (has_band && sg_active) {
        sg_active = qb < sq_hi && qb + BQ > sq_lo;
        need_band = !band.block_inside(qb, qb + BQ - 1, c0, c0 + 7);
      }
      // S^T (8 keys x BQ queries) = K Q^T; dP^T = V dO^T.
      simdgroup_float8x8 St[NQ];
      simdgroup_float8x8 dPt[NQ];
      if (sg_active) {
        // S^T: the forward's chains, transposed (q pre-scaled as it is there, k
        // as loaded; a product of two floats is commutative, so every score
        // equals the forward's bit for bit): one per score slice, added in order
        // (DS > 1: this simdgroup's slice, the others' added below).
        constexpr int SL = DS == 1 ? flash::ScoreSlices<BD>::value : 1;
        constexpr int NFS = NF / SL;
        for (int qq = 0; qq < NQ; ++qq) {
          for (int sl = 0; sl < SL; ++sl) {
            simdgroup_float8x8 part = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            for (int dd = sl * NFS; dd < (sl + 1) * NFS; ++dd) {
              simdgroup_float8x8 Qt;
              flash::load_frag_t(Qt, Qsl + qq * 8 * LD + dd * 8, LD, fc);
              flash::frag_scale(Qt, f.qk_scale);
              simdgroup_multiply_accumulate(part, flash_bwd::row_frag<kStageKV>(Kf, Ksg, LD, dd, fc), Qt, part);
            }
            if (sl == 0) {
              St[qq] = part;
            } else {
              flash::frag_add(St[qq], part);
            }
          }
          // dP^T: two chains, as in the dQ kernel.
          if (kDK) {
            simdgroup_float8x8 p1 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            dPt[qq] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            for (int dd = 0; dd < NF; dd += 2) {
              simdgroup_float8x8 dOt;
              flash::load_frag_t(dOt, dOsl + qq * 8 * LD + dd * 8, LD, fc);
              simdgroup_multiply_accumulate(dPt[qq], flash_bwd::row_frag<kStageKV>(Vf, Vsg, LD, dd, fc), dOt, dPt[qq]);
              flash::load_frag_t(dOt, dOsl + qq * 8 * LD + dd * 8 + 8, LD, fc);
              simdgroup_multiply_accumulate(p1, flash_bwd::row_frag<kStageKV>(Vf, Vsg, LD, dd + 1, fc), dOt, p1);
            }
            flash::frag_add(dPt[qq], p1);
          }
        }
      }
      // (DS > 1) the slices' S^T and dP^T summed; every simdgroup reaches the barrier
      if (DS > 1) flash::slice_sum<DS, NQ, kDK>(St, dPt, area, slice, sg_active, fc);
      if (sg_active) {
        const bool need_bounds = qb + BQ > Lq || c0 + 8 > Lk;
        for (int qq = 0; qq < NQ; ++qq) {
          for (int e = 0; e < 2; ++e) {
            const int ii = qq * 8 + fc.col + e;  // query within the block
            const int i = qb + ii;
            bool vis = true;
            if (need_bounds) vis = key_ok && i < Lq;
            if (need_band) vis = vis && band.visible(i, my_key);
            // (vis covers the query row: no separate mask guard)
            const flash::Score sc =
                flash::transform_score(St[qq].thread_elements()[e], i, my_key, sq.diag, slope, f.softcap, feat, mask,
                                       mask_base + long(i) * f.m_stride_q, true, vis);
            float s = sc.s;
            float grad = 1.0f;  // d score / d x of the flex score_mod
            if (kFlex) {
              s = flash::flex_score<true>(s, b, h, i, my_key, steps.sub.state(word, my_key, i), cap, vis, grad);
            }
            float pr = 0.0f;
            float ds = 0.0f;
            if (vis) {
              pr = flash_bwd::prob(s, kStatsStaged ? stat_tile[ii] : stats[stat_base + i]);
              const float zs = has_dropout ? (drop.keep(i, my_key) ? f.dropout_scale : 0.0f) : 1.0f;
              if (kDK) {
                const float row_delta = kStatsStaged ? delta_tile[ii] : delta[stat_base + i];
                ds = pr * (dPt[qq].thread_elements()[e] * zs - row_delta);
                flash::flex_line_grads<1>(col_acc, ds, sc.s, b, h, i, my_key, cap);
                if (has_softcap) ds *= 1.0f - sc.th * sc.th;
                if (kFlex) ds *= grad;
                ds *= p.scale;
              }
              pr *= zs;  // dV takes the dropped probabilities
            }
            St[qq].thread_elements()[e] = pr;
            if (kDK) dPt[qq].thread_elements()[e] = ds;
          }
        }
        // dV += P^T dO; dK += dS^T Q -- per block in a fresh fragment, then
        // one add (the accumulators sum over every query of every head of
        // the group: this keeps the rounding chain short).
        for (int dd = 0; dd < NF; ++dd) {
          if (kDV) {
            simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            for (int qq = 0; qq < NQ; ++qq) {
              simdgroup_float8x8 dOf;
              flash::load_frag(dOf, dOsl + qq * 8 * LD + dd * 8, LD, fc);
              simdgroup_multiply_accumulate(acc, St[qq], dOf, acc);
            }
            flash::frag_add(dVf[dd], acc);
          }
          if (kDK) {
            simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            for (int qq = 0; qq < NQ; ++qq) {
              simdgroup_float8x8 Qf;
              flash::load_frag(Qf, Qsl + qq * 8 * LD + dd * 8, LD, fc);
              simdgroup_multiply_accumulate(acc, dPt[qq], Qf, acc);
            }
            flash::frag_add(dKf[dd], acc);
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (kDK) flash::flex_store_lines<1>(FLEX_GRADS, col_acc, b, h, my_key, key_ok && slice == 0, fc, f, cap);
  }

  const int rows_out = sq.lk_rows - c0;  // zeros past seqused_k
  if (kDK) {
    device T* dkp = dk + long(sq.bt) * p.dk_stride_b + long(kvh) * p.dk_stride_h + key0 * p.dk_stride_l + col0;
    for (int dd = 0; dd < NF; ++dd) {
      flash::store_frag_device(dKf[dd], dkp + dd * 8, p.dk_stride_l, rows_out, f.head_dim - col0 - dd * 8, fc, 1.0f);
    }
  }
  if (kDV) {
    device T* dvp = dv + long(sq.bt) * p.dv_stride_b + long(kvh) * p.dv_stride_h + key0 * p.dv_stride_l + col0;
    for (int dd = 0; dd < NF; ++dd) {
      flash::store_frag_device(dVf[dd], dvp + dd * 8, p.dv_stride_l, rows_out, f.head_dim_v - col0 - dd * 8, fc,
                               1.0f);
    }
  }
}

// ---------------------------------------------------------------------------
// 4. dsinks[h] = -sum_{b,i} P_sink[b,h,i] * delta, P_sink = exp(sink[h] - m) / l, fixed order.
// ---------------------------------------------------------------------------
#define FLASH_BWD_DSINKS_ARGS                                                    \
  const device float2* stats [[buffer(0)]], const device float* delta [[buffer(1)]], \
      const device float* sinks [[buffer(2)]], device float* dsinks [[buffer(3)]], \
      constant FlashBwdParams& p [[buffer(6)]],                                  \
      uint3 tgid [[threadgroup_position_in_grid]],                               \
      ushort tid [[thread_index_in_threadgroup]]

template <int NT>
[[kernel]] void flash_bwd_dsinks(FLASH_BWD_DSINKS_ARGS) {
  threadgroup float part[NT];
  const int h = int(tgid.x);
  const int Lq = p.f.seqlen_q;
  const int n = p.f.batch * Lq;
  const float sink = sinks[h];
  float acc = 0.0f;
  for (int idx = tid; idx < n; idx += NT) {
    const int b = idx / Lq;
    const int i = idx - b * Lq;
    const long r = (long(b) * p.f.heads + h) * long(Lq) + i;
    acc += flash_bwd::prob(sink, stats[r]) * delta[r];
  }
  part[tid] = acc;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int s = NT / 2; s > 0; s /= 2) {
    if (tid < s) part[tid] += part[tid + s];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) dsinks[h] = -part[0];
}

// ---------------------------------------------------------------------------
// 5. FlexAttention: the gradient sums of the reads along diagonals.
// ---------------------------------------------------------------------------
// Grid (ceil((Lq + Lk - 1) / ND), Hq, B * FLEX_DIAG_READS), BQ / 8 simdgroups.
// A threadgroup owns ND consecutive diagonals t = i - j + Lk - 1 of one read
// (slot) and walks every query block: per key tile of the band its diagonals
// cross, S and dP as the dQ kernel computes them (the BlockMask's blocks that
// are not listed are skipped, full ones skip mask_mod), the element's
// dS * d score_mod / d read into a threadgroup tile, then thread t adds its
// diagonal's elements in row order.  One writer per diagonal, a fixed order:
// no partial rows per query block (O(B Hq (Lq + Lk)) memory), no atomics.
#define FLASH_BWD_DIAG_ARGS(T)                                                   \
  const device T* q [[buffer(0)]], const device T* k [[buffer(1)]],              \
      const device T* v [[buffer(2)]], const device T* dout [[buffer(3)]],       \
      const device float2* stats [[buffer(4)]], const device float* delta [[buffer(5)]], \
      constant FlashBwdParams& p [[buffer(6)]],                                  \
      FLEX_KERNEL_PARAMS FLEX_GRAD_PARAMS                                        \
      uint3 tgid [[threadgroup_position_in_grid]],                               \
      ushort tid [[thread_index_in_threadgroup]],                                \
      ushort sg [[simdgroup_index_in_threadgroup]],                              \
      ushort lane [[thread_index_in_simdgroup]]

template <typename T, int BD, int BQ, int BK>
[[kernel]] void flash_bwd_diag(FLASH_BWD_DIAG_ARGS(T)) {
  constexpr int NT = BQ / 8 * 32;
  constexpr int ND = BK < NT ? BK : NT;  // diagonals per threadgroup
  constexpr int LD = flash::TileLD<T, BD, 2 * BK>::value;
  constexpr int NF = BD / 8;
  constexpr int NK = BK / 8;
  static_assert(BQ % 8 == 0 && BK % 8 == 0 && BD % 16 == 0, "tile sizes (two chains over BD)");

  threadgroup T smem[2 * BK * LD];
  threadgroup float G[BQ * BK];  // the tile's contributions (0 off the owned diagonals)
  threadgroup T* Ks = smem;
  threadgroup T* Vs = smem + BK * LD;

  constant FlashFwdParams& f = p.f;
  const bool aligned = dims_aligned;
  const int slot = int(tgid.z) % flash::kFlexDiagSlots;
  const int b = int(tgid.z) / flash::kFlexDiagSlots;
  const int h = int(tgid.y);
  const int kvh = h / f.gqa;
  const int Lq = f.seqlen_q;
  const int Lk = f.seqlen_k;
  const int d0 = int(tgid.x) * ND;  // first owned diagonal
  const flash::FragCoord fc = flash::frag_coord(lane);
  const flex::Captured cap = FLEX_CAPTURED;
  flash::FlexSub sub{};
  if (kFlex) sub = flash::flex_sub(*FLEX_PARAMS_PTR);
  const device T* kp = k + long(b) * f.k_stride_b + long(kvh) * f.k_stride_h;
  const device T* vp = v + long(b) * f.v_stride_b + long(kvh) * f.v_stride_h;

  float acc = 0.0f;  // thread tid < ND: the sum of diagonal d0 + tid
  for (int q0 = 0; q0 < Lq; q0 += BQ) {
    // The keys where rows [q0, q0 + BQ) cross the owned diagonals.
    const int j_lo = max(q0 - (d0 + ND - 1) + Lk - 1, 0);
    const int j_hi = min(q0 + BQ - 1 - d0 + Lk - 1, Lk - 1);
    if (j_lo > j_hi) continue;  // uniform
    const int r0 = q0 + int(sg) * 8;
    const int my_row = r0 + fc.row;
    const bool row_ok = my_row < Lq;
    const long row0 = long(r0);
    const device T* qp = q + long(b) * f.q_stride_b + long(h) * f.q_stride_h + row0 * f.q_stride_l;
    const device T* dop = dout + long(b) * p.do_stride_b + long(h) * p.do_stride_h + row0 * p.do_stride_l;
    simdgroup_float8x8 Qf[NF];
    simdgroup_float8x8 dOf[NF];
    for (int dd = 0; dd < NF; ++dd) {
      flash::load_frag_device(Qf[dd], qp + dd * 8, f.q_stride_l, Lq - r0, f.head_dim - dd * 8, fc, f.qk_scale);
      flash::load_frag_device(dOf[dd], dop + dd * 8, p.do_stride_l, Lq - r0, f.head_dim_v - dd * 8, fc, 1.0f);
    }
    const long row_idx = (long(b) * f.heads + h) * long(f.seqlen_q) + my_row;
    const float2 my_stats = row_ok ? stats[row_idx] : float2(0.0f, 0.0f);
    const float my_delta = row_ok ? delta[row_idx] : 0.0f;

    for (int kb = (j_lo / BK) * BK; kb <= j_hi; kb += BK) {
      const uint word = flash::flex_block_word(FLEX_LISTS, b, h, q0, kb);
      if (word == 0u) continue;  // uniform: a block the BlockMask leaves out
      const int k_valid = Lk - kb;
      flash::load_tile<T, BK, BD, NT>(Ks, LD, kp + long(kb) * f.k_stride_l, f.k_stride_l, k_valid, f.head_dim,
                                      aligned, false, tid);
      flash::load_tile<T, BK, BD, NT>(Vs, LD, vp + long(kb) * f.v_stride_l, f.v_stride_l, k_valid, f.head_dim_v,
                                      aligned, false, tid);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      simdgroup_float8x8 S[NK];
      simdgroup_float8x8 dP[NK];
      flash::qk_block<NF, NK, LD>(S, Qf, Ks, fc);
      flash_bwd::dp_block<T, NF, NK, LD>(dP, dOf, Vs, fc);
      for (int kk = 0; kk < NK; ++kk) {
        for (int e = 0; e < 2; ++e) {
          const int j = kb + kk * 8 + fc.col + e;
          const int t = my_row - j + Lk - 1 - d0;
          float contribution = 0.0f;
          bool vis = row_ok && j < Lk && t >= 0 && t < ND;
          const float x = S[kk].thread_elements()[e];
          float unused;
          const int state = sub.state(word, my_row, j);
          const float s = flash::flex_score<false>(x, b, h, my_row, j, state, cap, vis, unused);
          if (vis) {
            const float ds = flash_bwd::prob(s, my_stats) * (dP[kk].thread_elements()[e] - my_delta);
            float g[flash::kFlexDiagSlots];
            flex::diag_grads(x, b, h, my_row, j, cap, g);
            contribution = ds * g[slot];
          }
          G[(my_row - q0) * BK + kk * 8 + fc.col + e] = contribution;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (tid < ND) {
        const int c_first = q0 - (d0 + int(tid)) + Lk - 1 - kb;  // column of row 0 on this diagonal
        for (int r = 0; r < BQ; ++r) {
          const int c = c_first + r;
          if (c >= 0 && c < BK) acc += G[r * BK + c];
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
  const int t = d0 + int(tid);
  if (tid < ND && t < Lq + Lk - 1) {
    const int i = max(0, t - (Lk - 1));  // an element of the diagonal
    const int index = flex::diag_index(slot, b, h, i, i - t + Lk - 1, cap);
    FLEX_GRADS[flash::flex_grad_entry(2, slot, b, h, t, f)] = flash::FlexPartial{index, acc};
  }
}

// ---------------------------------------------------------------------------
// 6. FlexAttention: a captured tensor's gradient from its lines' sums sorted by
//    index (on the host): element e is the sum of values[bounds[e] .. bounds[e + 1])
//    in order.  One writer per element, a fixed order.
// ---------------------------------------------------------------------------
#ifdef FLASH_FLEX
[[kernel]] void flash_bwd_segment_sum(const device float* values [[buffer(0)]],
                                      const device long* bounds [[buffer(1)]], device float* out [[buffer(2)]],
                                      constant int& n [[buffer(3)]], uint e [[thread_position_in_grid]]) {
  if (int(e) >= n) return;
  float acc = 0.0f;
  for (long i = bounds[e]; i < bounds[e + 1]; ++i) acc += values[i];
  out[e] = acc;
}
#endif  // FLASH_FLEX

// ---------------------------------------------------------------------------
// Instantiations.  Every entry of torch_metal_flash/planner/backward_tiles.py
// must appear here (a test checks).
// ---------------------------------------------------------------------------
#define FLASH_BWD_PRE_INSTANTIATE(tname, T)                                     \
  template [[host_name("flash_bwd_pre_" #tname)]] [[kernel]] void flash_bwd_pre<T>(FLASH_BWD_PRE_ARGS(T));

#define FLASH_BWD_DQ_INSTANTIATE(tname, T, BD, BQ, BK)                                          \
  template [[host_name("flash_bwd_dq_" #tname "_d" #BD "_q" #BQ "_k" #BK)]] [[kernel]] void     \
  flash_bwd_dq<T, BD, BQ, BK, 1>(FLASH_BWD_DQ_ARGS(T));
#define FLASH_BWD_DQ_INSTANTIATE_SPLIT(tname, T, BD, BQ, BK, DS)                                         \
  template [[host_name("flash_bwd_dq_" #tname "_d" #BD "_q" #BQ "_k" #BK "_ds" #DS)]] [[kernel]] void   \
  flash_bwd_dq<T, BD, BQ, BK, DS>(FLASH_BWD_DQ_ARGS(T));

#define FLASH_BWD_DKV_INSTANTIATE(tname, T, BD, BK, BQ, MODE)                                           \
  template [[host_name("flash_bwd_dkv_" #tname "_d" #BD "_k" #BK "_q" #BQ "_m" #MODE)]] [[kernel]] void \
  flash_bwd_dkv<T, BD, BK, BQ, MODE, 1>(FLASH_BWD_DKV_ARGS(T));
#define FLASH_BWD_DKV_INSTANTIATE_SPLIT(tname, T, BD, BK, BQ, MODE, DS)                                          \
  template [[host_name("flash_bwd_dkv_" #tname "_d" #BD "_k" #BK "_q" #BQ "_m" #MODE "_ds" #DS)]] [[kernel]] void \
  flash_bwd_dkv<T, BD, BK, BQ, MODE, DS>(FLASH_BWD_DKV_ARGS(T));

#define FLASH_BWD_DIAG_INSTANTIATE(tname, T, BD, BQ, BK)                                          \
  template [[host_name("flash_bwd_diag_" #tname "_d" #BD "_q" #BQ "_k" #BK)]] [[kernel]] void     \
  flash_bwd_diag<T, BD, BQ, BK>(FLASH_BWD_DIAG_ARGS(T));

#ifndef FLASH_BWD_TEMPLATES_ONLY  // the tuning variants' file includes this one for the templates only
template [[host_name("flash_bwd_dsinks")]] [[kernel]] void flash_bwd_dsinks<256>(FLASH_BWD_DSINKS_ARGS);

FLASH_BWD_PRE_INSTANTIATE(f32, float)
FLASH_BWD_PRE_INSTANTIATE(f16, half)
FLASH_BWD_PRE_INSTANTIATE(bf16, bfloat)

// dQ (T, BD, BQ, BK[, DS]): K + V tiles of BK x (BD + pad) elements (and the
// head-dim split's partial S and dP at 384/512).
FLASH_BWD_DQ_INSTANTIATE(f32, float, 32, 64, 32)
FLASH_BWD_DQ_INSTANTIATE(f32, float, 64, 64, 32)
FLASH_BWD_DQ_INSTANTIATE(f32, float, 80, 64, 16)
FLASH_BWD_DQ_INSTANTIATE(f32, float, 96, 64, 16)
FLASH_BWD_DQ_INSTANTIATE(f32, float, 128, 64, 16)
FLASH_BWD_DQ_INSTANTIATE(f32, float, 160, 32, 8)
FLASH_BWD_DQ_INSTANTIATE(f32, float, 192, 32, 8)
FLASH_BWD_DQ_INSTANTIATE(f32, float, 256, 32, 8)
FLASH_BWD_DQ_INSTANTIATE_SPLIT(f32, float, 384, 16, 8, 4)
FLASH_BWD_DQ_INSTANTIATE(f32, float, 512, 32, 8)
FLASH_BWD_DQ_INSTANTIATE(f16, half, 32, 64, 32)
FLASH_BWD_DQ_INSTANTIATE(f16, half, 64, 64, 32)
FLASH_BWD_DQ_INSTANTIATE(f16, half, 80, 64, 32)
FLASH_BWD_DQ_INSTANTIATE(f16, half, 96, 64, 32)
FLASH_BWD_DQ_INSTANTIATE(f16, half, 128, 64, 32)
FLASH_BWD_DQ_INSTANTIATE(f16, half, 160, 32, 16)
FLASH_BWD_DQ_INSTANTIATE(f16, half, 192, 32, 16)
FLASH_BWD_DQ_INSTANTIATE(f16, half, 256, 32, 16)
FLASH_BWD_DQ_INSTANTIATE_SPLIT(f16, half, 384, 32, 8, 4)
FLASH_BWD_DQ_INSTANTIATE_SPLIT(f16, half, 512, 32, 8, 4)
FLASH_BWD_DQ_INSTANTIATE(bf16, bfloat, 32, 64, 32)
FLASH_BWD_DQ_INSTANTIATE(bf16, bfloat, 64, 64, 32)
FLASH_BWD_DQ_INSTANTIATE(bf16, bfloat, 80, 64, 32)
FLASH_BWD_DQ_INSTANTIATE(bf16, bfloat, 96, 64, 32)
FLASH_BWD_DQ_INSTANTIATE(bf16, bfloat, 128, 64, 32)
FLASH_BWD_DQ_INSTANTIATE(bf16, bfloat, 160, 32, 16)
FLASH_BWD_DQ_INSTANTIATE(bf16, bfloat, 192, 32, 16)
FLASH_BWD_DQ_INSTANTIATE(bf16, bfloat, 256, 32, 16)
FLASH_BWD_DQ_INSTANTIATE_SPLIT(bf16, bfloat, 384, 32, 8, 4)
FLASH_BWD_DQ_INSTANTIATE_SPLIT(bf16, bfloat, 512, 32, 8, 4)

// dK/dV (T, BD, BK, BQ, MODE): Q + dO tiles of BQ x (BD + pad) elements, plus (fused
// above head dim 64) the K and V rows, BK x (BD + pad) each; fused (MODE 0) up to
// BD 256 and with the head dim split over 4 simdgroups above (DS 4: K, V and the
// accumulators in registers, partial S^T and dP^T in threadgroup memory), float32
// at 512 (whose Q and dO tiles fill 32 KiB) split into a dK (MODE 1) and a dV
// (MODE 2) kernel.
FLASH_BWD_DKV_INSTANTIATE(f32, float, 32, 64, 32, 0)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 64, 64, 32, 0)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 80, 32, 8, 0)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 96, 32, 8, 0)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 128, 16, 8, 0)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 160, 16, 8, 0)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 192, 8, 8, 0)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 256, 8, 8, 0)
FLASH_BWD_DKV_INSTANTIATE_SPLIT(f32, float, 384, 16, 8, 0, 4)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 512, 32, 8, 1)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 512, 32, 8, 2)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 32, 64, 32, 0)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 64, 64, 32, 0)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 80, 32, 16, 0)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 96, 32, 16, 0)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 128, 32, 8, 0)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 160, 16, 8, 0)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 192, 16, 8, 0)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 256, 16, 8, 0)
FLASH_BWD_DKV_INSTANTIATE_SPLIT(f16, half, 384, 32, 8, 0, 4)
FLASH_BWD_DKV_INSTANTIATE_SPLIT(f16, half, 512, 32, 8, 0, 4)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 32, 64, 32, 0)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 64, 64, 32, 0)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 80, 32, 16, 0)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 96, 32, 16, 0)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 128, 32, 8, 0)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 160, 16, 8, 0)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 192, 16, 8, 0)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 256, 16, 8, 0)
FLASH_BWD_DKV_INSTANTIATE_SPLIT(bf16, bfloat, 384, 32, 8, 0, 4)
FLASH_BWD_DKV_INSTANTIATE_SPLIT(bf16, bfloat, 512, 32, 8, 0, 4)
#endif  // FLASH_BWD_TEMPLATES_ONLY
