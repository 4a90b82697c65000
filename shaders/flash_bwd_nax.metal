// FlashAttention-2 backward on the neural accelerators (Metal 4 tensor ops,
// MSL 4.0; GPUs of family apple10, M5): flash_bwd.metal's dQ and dK/dV
// kernels, buffers, params and function constants, with 16x16 accelerator
// fragments (flash_nax.h) in place of 8x8 simdgroup matrices.  The
// preprocess and dsinks kernels (no matrix products) stay flash_bwd.metal's.
//
// Scores: the NAX forward's, bit for bit.  Q and K stay in their own type,
// S = Q K^T is one multiply-accumulate chain over the head dim in order (the
// dK/dV kernel runs it as K Q^T: each element is the same chain of fused
// multiply-adds of the same products), and qk_scale is applied to the float
// score before flash::transform_score, as flash_fwd_nax.metal computes them.
// P = exp(s - m) / l with the forward's row state, dS, the softcap chain rule,
// dropout, dbias and dlse exactly as flash_bwd.metal.
//
//  flash_bwd_dq_nax_<dt>_d<BD>_q<BQ>_k<BK>[_s]: grid (ceil(Lq/BQ), Hq, B),
//    16 query rows per simdgroup (two per lane, 8 apart); Q, dO (in T) and the
//    float dQ accumulator in registers; K and V tiles of BK rows stream through
//    threadgroup memory (_s: one buffer, V first for dP = dO V^T, then K for S
//    and dQ += dS K).  Per lane: D/2 + D/2 elements of Q/dO plus D/2 floats.
//  flash_bwd_dkv_nax_<dt>_d<BD>_k<BK>_q<BQ>_m<MODE>: grid (ceil(Lk/BK), Hkv, B),
//    16 key rows per simdgroup; K, V (in T) and the float dK / dV accumulators
//    in registers; Q and dO tiles of BQ rows (and their stats / delta) stream
//    through threadgroup memory over the GQA group's heads and the band's
//    query blocks.  MODE as flash_bwd.metal (0 fused, 1 dK, 2 dV).
//
// Register budget (per lane, 16 rows per simdgroup, 32-bit registers, 16-bit
// elements two to a register): the fused dK/dV kernel holds D/2 + D/2
// elements of K and V and D floats of dK / dV accumulators, 96 registers at
// D = 64 but 192 at D = 128 (plus the S^T / dP^T blocks); split, the dK kernel
// (MODE 1: K, V, dK) holds 128 at D = 128, the dV kernel (MODE 2: K, dV) 96,
// no more than the NAX forward's 192 at D = 256 (Q in T, O in float).  So the
// accelerator dK/dV kernels take D <= 128: fused up to 64, split above (as
// flash_bwd.metal).  The dQ kernel (Q, dO in T, dQ in float: D registers)
// takes every bucket the NAX forward takes, to 256.  float32, the bucket 80
// (the multiplies take 32 head-dim columns at a time), head dims above 256
// (dQ) or 128 (dK/dV) stay on flash_bwd.metal's simdgroup kernels; a plan
// may mix an accelerator dQ with a simdgroup dK/dV kernel.
//
// All products are 16x32x16 matmul2d multiplies (flash::nax::mma): the head
// dims (BD) and the key / query blocks (BK of the dQ kernel, BQ of the dK/dV
// kernel) are multiples of 32.
#define FLASH_BWD_TEMPLATES_ONLY
#include "flash_bwd.metal"
#include "flash_nax.h"

// ---------------------------------------------------------------------------
// dQ (and dbias).
// ---------------------------------------------------------------------------
template <typename T, int BD, int BQ, int BK, bool SHARED_KV>
[[kernel]] void flash_bwd_dq_nax(FLASH_BWD_DQ_ARGS(T)) {
  constexpr int WM = BQ / 16;
  constexpr int NT = WM * 32;
  constexpr int TILES = SHARED_KV ? 1 : 2;
  constexpr int LD = flash::TileLD<T, BD, TILES * BK>::value;
  constexpr int NF = BD / 16;
  constexpr int NK = BK / 16;
  static_assert(BQ % 16 == 0 && BK % 32 == 0 && BD % 32 == 0, "tile sizes");
  using Acc = flash::nax::Frag<float>;

  threadgroup T smem[TILES * BK * LD];
  threadgroup T* Ks = smem;
  threadgroup T* Vs = SHARED_KV ? smem : smem + BK * LD;

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
  const int r0 = q0 + int(sg) * 16;
  const flash::nax::Coord fc = flash::nax::coord(ushort(lane));
  const int i_last = min(q0 + BQ, Lq) - 1;

  const long row0 = long(sq.q0 + r0);  // the simdgroup's first row in the tensors
  const device T* qp = q + long(sq.bt) * f.q_stride_b + long(h) * f.q_stride_h + row0 * f.q_stride_l;
  const device T* dop = dout + long(sq.bt) * p.do_stride_b + long(h) * p.do_stride_h + row0 * p.do_stride_l;
  const device T* kp = k + long(sq.bt) * f.k_stride_b + long(kvh) * f.k_stride_h + long(sq.k0) * f.k_stride_l;
  const device T* vp = v + long(sq.bt) * f.v_stride_b + long(kvh) * f.v_stride_h + long(sq.k0) * f.v_stride_l;

  // Q as the forward holds it (its type, unscaled, zero past Lq and head_dim); dO likewise.
  flash::nax::Frag<T> Qf[NF];
  flash::nax::Frag<T> dOf[NF];
  Acc dQf[NF];
  flash::nax::load_device<T, NF>(Qf, qp, f.q_stride_l, Lq - r0, f.head_dim, fc);
  flash::nax::load_device<T, NF>(dOf, dop, p.do_stride_l, Lq - r0, f.head_dim_v, fc);
  for (int dd = 0; dd < NF; ++dd) flash::nax::zero(dQf[dd]);

  // This lane's two rows (r0 + fc.row + 8 hh): position, stats, delta, mask / dbias rows.
  int ii[2];
  bool row_ok[2];
  float2 st[2];
  float dl[2];
  long mask_row[2] = {0, 0};
  device float* db_row[2] = {nullptr, nullptr};
  for (int hh = 0; hh < 2; ++hh) {
    ii[hh] = r0 + fc.row + 8 * hh;
    row_ok[hh] = ii[hh] < Lq;
    const long row_idx = (long(sq.bt) * f.heads + h) * long(f.seqlen_q) + sq.q0 + ii[hh];
    st[hh] = row_ok[hh] ? stats[row_idx] : float2(0.0f, 0.0f);
    dl[hh] = row_ok[hh] ? delta[row_idx] : 0.0f;
    if (has_mask) mask_row[hh] = long(b) * f.m_stride_b + long(h) * f.m_stride_h + long(ii[hh]) * f.m_stride_q;
    if (has_dbias) {
      db_row[hh] = dbias + long(b) * p.db_stride_b + long(h) * p.db_stride_h + long(ii[hh]) * p.db_stride_q;
    }
  }
  flash::Dropout drop{};
  if (has_dropout) drop = flash::dropout_of(rng, b, f.heads, h, f.dropout_threshold);
  float slope = 0.0f;
  if (has_alibi) slope = alibi[long(b) * f.a_stride_b + long(h) * f.a_stride_h];

  const flash::Band band{sq.diag, f.window_left, f.window_right};
  const flash::ScoreFeatures feat{has_softcap, has_alibi, has_mask, mask_kind};
  int k_lo = 0;
  int k_hi = Lk;
  if (has_band) band.key_range(q0, i_last, Lk, k_lo, k_hi);
  const int kb_begin = (k_lo / BK) * BK;
  int kb_end = kb_begin;

  for (int kb = kb_begin; kb < k_hi; kb += BK) {
    kb_end = kb + BK;
    const int k_valid = Lk - kb;
    // V first: dP = dO V^T needs V only; with one buffer K follows it.
    flash::load_tile<T, BK, BD, NT>(Vs, LD, vp + long(kb) * f.v_stride_l, f.v_stride_l, k_valid, f.head_dim_v,
                                    aligned, false, tid);
    if (!SHARED_KV) {
      flash::load_tile<T, BK, BD, NT>(Ks, LD, kp + long(kb) * f.k_stride_l, f.k_stride_l, k_valid, f.head_dim,
                                      aligned, false, tid);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const int sg_last = min(r0 + 15, Lq - 1);
    bool sg_active = r0 < Lq;
    bool need_band = false;
    if (has_band && sg_active) {
      int lo, hi;
      band.key_range(r0, sg_last, Lk, lo, hi);
      sg_active = kb < hi && kb + BK > lo;
      need_band = !band.block_inside(r0, sg_last, kb, kb + BK - 1);
    }
    Acc S[NK];
    Acc dP[NK];
    if (sg_active) {
      // dP = dO V^T, 32 keys per multiply: two chains (even / odd head-dim
      // fragments) summed at the end, half the rounding-error growth of one.
      for (int kk = 0; kk < NK; kk += 2) {
        Acc odd0, odd1;
        flash::nax::zero(dP[kk]);
        flash::nax::zero(dP[kk + 1]);
        flash::nax::zero(odd0);
        flash::nax::zero(odd1);
        for (int dd = 0; dd < NF; dd += 2) {
          flash::nax::Frag<T> Vt[2];
          flash::nax::load_bt<T, LD>(Vt, Vs + kk * 16 * LD + dd * 16, fc);
          flash::nax::mma<true>(dP[kk], dP[kk + 1], dOf[dd], Vt);
          flash::nax::load_bt<T, LD>(Vt, Vs + kk * 16 * LD + dd * 16 + 16, fc);
          flash::nax::mma<true>(odd0, odd1, dOf[dd + 1], Vt);
        }
        flash::nax::add(dP[kk], odd0);
        flash::nax::add(dP[kk + 1], odd1);
      }
    }
    if (SHARED_KV) {  // every simdgroup is done with V: bring K into the same buffer
      threadgroup_barrier(mem_flags::mem_threadgroup);
      flash::load_tile<T, BK, BD, NT>(Ks, LD, kp + long(kb) * f.k_stride_l, f.k_stride_l, k_valid, f.head_dim,
                                      aligned, false, tid);
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (sg_active) {
      // S = Q K^T: the NAX forward's chain (32 keys per multiply, the head dim in order).
      for (int kk = 0; kk < NK; kk += 2) {
        flash::nax::zero(S[kk]);
        flash::nax::zero(S[kk + 1]);
        for (int dd = 0; dd < NF; ++dd) {
          flash::nax::Frag<T> Kt[2];
          flash::nax::load_bt<T, LD>(Kt, Ks + kk * 16 * LD + dd * 16, fc);
          flash::nax::mma<true>(S[kk], S[kk + 1], Qf[dd], Kt);
        }
      }
      // dS, element-wise (kept in S): element e of S[kk] is row ii[e / 4], key kb + 16 kk + fc.col + e % 4.
      const bool need_bounds = kb + BK > Lk;
      for (int kk = 0; kk < NK; ++kk) {
        for (int hh = 0; hh < 2; ++hh) {
          const int j0 = kb + kk * 16 + fc.col;
          bool4 keep = bool4(true);
          if (has_dropout) keep = drop.keep4(ii[hh], j0);
          for (int c = 0; c < 4; ++c) {
            const int e = 4 * hh + c;
            const int j = j0 + c;
            bool vis = row_ok[hh];
            if (need_bounds) vis = vis && j < Lk;
            if (need_band) vis = vis && band.visible(ii[hh], j);
            const flash::Score sc =
                flash::transform_score(S[kk].e[e] * f.qk_scale, ii[hh], j, sq.diag, slope, f.softcap, feat, mask,
                                       mask_row[hh] + long(j) * f.m_stride_k, row_ok[hh], vis);
            float ds = 0.0f;
            if (vis) {
              const float zs = has_dropout ? (keep[c] ? f.dropout_scale : 0.0f) : 1.0f;
              const float pr = flash_bwd::prob(sc.s, st[hh]);
              ds = pr * (dP[kk].e[e] * zs - dl[hh]);
            }
            if (has_dbias && row_ok[hh] && j < Lk) db_row[hh][j] = ds;
            if (has_softcap) ds *= 1.0f - sc.th * sc.th;
            S[kk].e[e] = ds * p.scale;
          }
        }
      }
      // dQ += dS K: 32 head-dim columns per multiply, the block's product in a
      // fresh pair of fragments, then one add (a short rounding chain).
      for (int dd = 0; dd < NF; dd += 2) {
        Acc acc0, acc1;
        flash::nax::zero(acc0);
        flash::nax::zero(acc1);
        for (int kk = 0; kk < NK; ++kk) {
          flash::nax::Frag<T> Kb[2];
          flash::nax::load_b<T, LD>(Kb, Ks + kk * 16 * LD + dd * 16, fc);
          flash::nax::mma<false>(acc0, acc1, S[kk], Kb);
        }
        flash::nax::add(dQf[dd], acc0);
        flash::nax::add(dQf[dd + 1], acc1);
      }
    } else if (has_dbias) {
      for (int hh = 0; hh < 2; ++hh) {
        if (!row_ok[hh]) continue;
        for (int kk = 0; kk < NK; ++kk) {
          for (int c = 0; c < 4; ++c) {
            const int j = kb + kk * 16 + fc.col + c;
            if (j < Lk) db_row[hh][j] = 0.0f;
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // dbias is zero outside the key blocks the band touches.
  if (has_dbias) {
    const int hi_start = min(kb_end, Lk);
    for (int rr = 0; rr < 16; ++rr) {
      const int i = r0 + rr;
      if (i >= Lq) break;
      device float* drow = dbias + long(b) * p.db_stride_b + long(h) * p.db_stride_h + long(i) * p.db_stride_q;
      for (int j = lane; j < kb_begin && j < Lk; j += 32) drow[j] = 0.0f;
      for (int j = hi_start + lane; j < Lk; j += 32) drow[j] = 0.0f;
    }
  }

  device T* dqp = dq + long(sq.bt) * p.dq_stride_b + long(h) * p.dq_stride_h + row0 * p.dq_stride_l;
  flash::nax::store_device<T, NF>(dQf, dqp, p.dq_stride_l, Lq - r0, f.head_dim, fc);
}

// ---------------------------------------------------------------------------
// dK and dV.
// ---------------------------------------------------------------------------
template <typename T, int BD, int BK, int BQ, int MODE>
[[kernel]] void flash_bwd_dkv_nax(FLASH_BWD_DKV_ARGS(T)) {
  constexpr int WM = BK / 16;
  constexpr int NT = WM * 32;
  constexpr int LD = flash::TileLD<T, BD, 2 * BQ>::value;
  constexpr int NF = BD / 16;
  constexpr int NQ = BQ / 16;
  // The block's row statistics staged next to the Q and dO tiles where they fit (flash_bwd_dkv's rule).
  constexpr bool kStatsStaged = 2 * BQ * LD * int(sizeof(T)) + BQ * 12 <= flash::kThreadgroupBytes;
  constexpr bool kDK = MODE != 2;
  constexpr bool kDV = MODE != 1;
  static_assert(BK % 16 == 0 && BQ % 32 == 0 && BD % 32 == 0, "tile sizes");
  using Acc = flash::nax::Frag<float>;

  constexpr int STAT_ELEMS = kStatsStaged ? BQ * 12 / int(sizeof(T)) : 0;
  threadgroup T smem[2 * BQ * LD + STAT_ELEMS];
  threadgroup float2* stat_tile = reinterpret_cast<threadgroup float2*>(smem + 2 * BQ * LD);
  threadgroup float* delta_tile = reinterpret_cast<threadgroup float*>(stat_tile + BQ);
  threadgroup T* Qs = smem;
  threadgroup T* dOs = smem + BQ * LD;

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
  const int c0 = kb0 + int(sg) * 16;  // first key row of this simdgroup
  const flash::nax::Coord fc = flash::nax::coord(ushort(lane));
  int my_key[2];
  bool key_ok[2];
  for (int hh = 0; hh < 2; ++hh) {
    my_key[hh] = c0 + fc.row + 8 * hh;
    key_ok[hh] = my_key[hh] < Lk;
  }

  const long key0 = long(sq.k0 + c0);  // the simdgroup's first key row in the tensors
  const device T* kp = k + long(sq.bt) * f.k_stride_b + long(kvh) * f.k_stride_h + key0 * f.k_stride_l;
  const device T* vp = v + long(sq.bt) * f.v_stride_b + long(kvh) * f.v_stride_h + key0 * f.v_stride_l;

  flash::nax::Frag<T> Kf[NF];
  flash::nax::Frag<T> Vf[NF];
  Acc dKf[NF];
  Acc dVf[NF];
  flash::nax::load_device<T, NF>(Kf, kp, f.k_stride_l, Lk - c0, f.head_dim, fc);
  if (kDK) flash::nax::load_device<T, NF>(Vf, vp, f.v_stride_l, Lk - c0, f.head_dim_v, fc);
  for (int dd = 0; dd < NF; ++dd) {
    if (kDK) flash::nax::zero(dKf[dd]);
    if (kDV) flash::nax::zero(dVf[dd]);
  }

  // Query rows whose band reaches this threadgroup's keys, and this simdgroup's.
  const flash::Band band{sq.diag, f.window_left, f.window_right};
  const flash::ScoreFeatures feat{has_softcap, has_alibi, has_mask, mask_kind};
  const int kb_last = min(kb0 + BK, Lk) - 1;
  int q_lo = 0;
  int q_hi = kb0 < Lk ? Lq : 0;  // keys past seqused_k see no query
  if (has_band) flash::query_range(band, kb0, kb_last, Lq, q_lo, q_hi);
  const int qb_begin = (q_lo / BQ) * BQ;
  const int sg_klast = min(c0 + 15, Lk - 1);
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
    long mask_base[2] = {0, 0};
    for (int hh = 0; has_mask && hh < 2; ++hh) {
      mask_base[hh] = long(b) * f.m_stride_b + long(h) * f.m_stride_h + long(my_key[hh]) * f.m_stride_k;
    }

    for (int qb = qb_begin; qb < q_hi; qb += BQ) {
      const int q_valid = Lq - qb;
      flash::load_tile<T, BQ, BD, NT>(Qs, LD, qp + long(qb) * f.q_stride_l, f.q_stride_l, q_valid, f.head_dim,
                                      aligned, false, tid);
      flash::load_tile<T, BQ, BD, NT>(dOs, LD, dop + long(qb) * p.do_stride_l, p.do_stride_l, q_valid,
                                      f.head_dim_v, aligned, false, tid);
      for (int t = tid; kStatsStaged && t < BQ; t += NT) {
        const bool ok = qb + t < Lq;
        stat_tile[t] = ok ? stats[stat_base + qb + t] : float2(0.0f, 0.0f);
        delta_tile[t] = ok ? delta[stat_base + qb + t] : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      bool sg_active = c0 < Lk;
      bool need_band = false;
      if (has_band && sg_active) {
        sg_active = qb < sq_hi && qb + BQ > sq_lo;
        need_band = !band.block_inside(qb, qb + BQ - 1, c0, c0 + 15);
      }
      if (sg_active) {
        // S^T (16 keys x BQ queries) = K Q^T: per element the forward's chain
        // over the head dim (the same products, in the same order).  dP^T =
        // V dO^T in two chains, as in the dQ kernel.
        Acc St[NQ];
        Acc dPt[NQ];
        for (int qq = 0; qq < NQ; qq += 2) {
          flash::nax::zero(St[qq]);
          flash::nax::zero(St[qq + 1]);
          for (int dd = 0; dd < NF; ++dd) {
            flash::nax::Frag<T> Qt[2];
            flash::nax::load_bt<T, LD>(Qt, Qs + qq * 16 * LD + dd * 16, fc);
            flash::nax::mma<true>(St[qq], St[qq + 1], Kf[dd], Qt);
          }
          if (kDK) {
            Acc odd0, odd1;
            flash::nax::zero(dPt[qq]);
            flash::nax::zero(dPt[qq + 1]);
            flash::nax::zero(odd0);
            flash::nax::zero(odd1);
            for (int dd = 0; dd < NF; dd += 2) {
              flash::nax::Frag<T> dOt[2];
              flash::nax::load_bt<T, LD>(dOt, dOs + qq * 16 * LD + dd * 16, fc);
              flash::nax::mma<true>(dPt[qq], dPt[qq + 1], Vf[dd], dOt);
              flash::nax::load_bt<T, LD>(dOt, dOs + qq * 16 * LD + dd * 16 + 16, fc);
              flash::nax::mma<true>(odd0, odd1, Vf[dd + 1], dOt);
            }
            flash::nax::add(dPt[qq], odd0);
            flash::nax::add(dPt[qq + 1], odd1);
          }
        }
        // Element e of St[qq]: key my_key[e / 4], query qb + 16 qq + fc.col + e % 4.
        const bool need_bounds = qb + BQ > Lq || c0 + 16 > Lk;
        for (int qq = 0; qq < NQ; ++qq) {
          for (int e = 0; e < 8; ++e) {
            const int hh = e / 4;
            const int ii = qq * 16 + fc.col + e % 4;  // query within the block
            const int i = qb + ii;
            bool vis = true;
            if (need_bounds) vis = key_ok[hh] && i < Lq;
            if (need_band) vis = vis && band.visible(i, my_key[hh]);
            // (vis covers the query row: no separate mask guard)
            const flash::Score sc =
                flash::transform_score(St[qq].e[e] * f.qk_scale, i, my_key[hh], sq.diag, slope, f.softcap, feat,
                                       mask, mask_base[hh] + long(i) * f.m_stride_q, true, vis);
            float pr = 0.0f;
            float ds = 0.0f;
            if (vis) {
              pr = flash_bwd::prob(sc.s, kStatsStaged ? stat_tile[ii] : stats[stat_base + i]);
              const float zs = has_dropout ? (drop.keep(i, my_key[hh]) ? f.dropout_scale : 0.0f) : 1.0f;
              if (kDK) {
                const float row_delta = kStatsStaged ? delta_tile[ii] : delta[stat_base + i];
                ds = pr * (dPt[qq].e[e] * zs - row_delta);
                if (has_softcap) ds *= 1.0f - sc.th * sc.th;
                ds *= p.scale;
              }
              pr *= zs;  // dV takes the dropped probabilities
            }
            St[qq].e[e] = pr;
            if (kDK) dPt[qq].e[e] = ds;
          }
        }
        // dV += P^T dO; dK += dS^T Q: 32 head-dim columns per multiply, the
        // block's product in a fresh pair of fragments, then one add.
        for (int dd = 0; dd < NF; dd += 2) {
          if (kDV) {
            Acc acc0, acc1;
            flash::nax::zero(acc0);
            flash::nax::zero(acc1);
            for (int qq = 0; qq < NQ; ++qq) {
              flash::nax::Frag<T> dOb[2];
              flash::nax::load_b<T, LD>(dOb, dOs + qq * 16 * LD + dd * 16, fc);
              flash::nax::mma<false>(acc0, acc1, St[qq], dOb);
            }
            flash::nax::add(dVf[dd], acc0);
            flash::nax::add(dVf[dd + 1], acc1);
          }
          if (kDK) {
            Acc acc0, acc1;
            flash::nax::zero(acc0);
            flash::nax::zero(acc1);
            for (int qq = 0; qq < NQ; ++qq) {
              flash::nax::Frag<T> Qb[2];
              flash::nax::load_b<T, LD>(Qb, Qs + qq * 16 * LD + dd * 16, fc);
              flash::nax::mma<false>(acc0, acc1, dPt[qq], Qb);
            }
            flash::nax::add(dKf[dd], acc0);
            flash::nax::add(dKf[dd + 1], acc1);
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }

  const int rows_out = sq.lk_rows - c0;  // zeros past seqused_k
  if (kDK) {
    device T* dkp = dk + long(sq.bt) * p.dk_stride_b + long(kvh) * p.dk_stride_h + key0 * p.dk_stride_l;
    flash::nax::store_device<T, NF>(dKf, dkp, p.dk_stride_l, rows_out, f.head_dim, fc);
  }
  if (kDV) {
    device T* dvp = dv + long(sq.bt) * p.dv_stride_b + long(kvh) * p.dv_stride_h + key0 * p.dv_stride_l;
    flash::nax::store_device<T, NF>(dVf, dvp, p.dv_stride_l, rows_out, f.head_dim_v, fc);
  }
}

// ---------------------------------------------------------------------------
// Instantiations: one tile list per dtype; every accelerator entry of
// torch_metal_flash/planner/backward_tiles.py must appear here (a test checks).
// ---------------------------------------------------------------------------
#define FLASH_BWD_DQ_NAX_INSTANTIATE(tname, T, BD, BQ, BK)                                          \
  template [[host_name("flash_bwd_dq_nax_" #tname "_d" #BD "_q" #BQ "_k" #BK)]] [[kernel]] void     \
  flash_bwd_dq_nax<T, BD, BQ, BK, false>(FLASH_BWD_DQ_ARGS(T));
#define FLASH_BWD_DQ_NAX_INSTANTIATE_SHARED(tname, T, BD, BQ, BK)                                       \
  template [[host_name("flash_bwd_dq_nax_" #tname "_d" #BD "_q" #BQ "_k" #BK "_s")]] [[kernel]] void    \
  flash_bwd_dq_nax<T, BD, BQ, BK, true>(FLASH_BWD_DQ_ARGS(T));
#define FLASH_BWD_DKV_NAX_INSTANTIATE(tname, T, BD, BK, BQ, MODE)                                           \
  template [[host_name("flash_bwd_dkv_nax_" #tname "_d" #BD "_k" #BK "_q" #BQ "_m" #MODE)]] [[kernel]] void \
  flash_bwd_dkv_nax<T, BD, BK, BQ, MODE>(FLASH_BWD_DKV_ARGS(T));

#define FLASH_BWD_NAX_TILES(tname, T)                          \
  FLASH_BWD_DQ_NAX_INSTANTIATE(tname, T, 32, 64, 32)           \
  FLASH_BWD_DQ_NAX_INSTANTIATE(tname, T, 64, 64, 32)           \
  FLASH_BWD_DQ_NAX_INSTANTIATE(tname, T, 64, 32, 32)           \
  FLASH_BWD_DQ_NAX_INSTANTIATE(tname, T, 96, 64, 32)           \
  FLASH_BWD_DQ_NAX_INSTANTIATE(tname, T, 128, 64, 32)          \
  FLASH_BWD_DQ_NAX_INSTANTIATE(tname, T, 128, 32, 32)          \
  FLASH_BWD_DQ_NAX_INSTANTIATE_SHARED(tname, T, 160, 32, 32)   \
  FLASH_BWD_DQ_NAX_INSTANTIATE_SHARED(tname, T, 192, 32, 32)   \
  FLASH_BWD_DQ_NAX_INSTANTIATE_SHARED(tname, T, 256, 32, 32)   \
  FLASH_BWD_DQ_NAX_INSTANTIATE_SHARED(tname, T, 256, 64, 32)   \
  FLASH_BWD_DKV_NAX_INSTANTIATE(tname, T, 32, 64, 32, 0)       \
  FLASH_BWD_DKV_NAX_INSTANTIATE(tname, T, 64, 64, 32, 0)       \
  FLASH_BWD_DKV_NAX_INSTANTIATE(tname, T, 64, 32, 32, 0)       \
  FLASH_BWD_DKV_NAX_INSTANTIATE(tname, T, 96, 64, 32, 1)       \
  FLASH_BWD_DKV_NAX_INSTANTIATE(tname, T, 96, 64, 32, 2)       \
  FLASH_BWD_DKV_NAX_INSTANTIATE(tname, T, 128, 64, 32, 1)      \
  FLASH_BWD_DKV_NAX_INSTANTIATE(tname, T, 128, 64, 32, 2)      \
  FLASH_BWD_DKV_NAX_INSTANTIATE(tname, T, 128, 32, 32, 1)      \
  FLASH_BWD_DKV_NAX_INSTANTIATE(tname, T, 128, 32, 32, 2)

FLASH_BWD_NAX_TILES(f16, half)
FLASH_BWD_NAX_TILES(bf16, bfloat)
