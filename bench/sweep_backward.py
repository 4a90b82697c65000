"""Full backward kernel sweep in the emulator (every axis of the backward matrix).

The CI test (tests/kernels/test_backward_kernels.py) runs a fixed-seed sample; this
script runs the forward kernels' whole matrix for the backward (dtype x head
dim x (Lq, Lk) x masking, with GQA ratio -- including 8:1 and MQA --, feature,
layout, dlse and dbias rotated through their values), each case in checked
mode and two schedule orders (bitwise equal), against float64 autograd with
the acceptance rule (torch_metal_flash/testing/oracle.py) on dq, dk, dv, dbias, dsinks.

    python bench/sweep_backward.py                       # 1,728 cases
    python bench/sweep_backward.py --every-combination   # x GQA x features x layouts
    python bench/sweep_backward.py --max-elems 20000 --shard 0/4
    python bench/sweep_backward.py --sample 200 --seed 1
"""
from __future__ import annotations

import itertools
import sys
import time
import traceback

import harness

from torch_metal_flash.testing import backward_cases as bk
from torch_metal_flash.testing import forward_cases as fc


def full_matrix(every_combination: bool = False):
    rot = list(itertools.product(bk.GQA_BWD, fc.FEATURES, fc.LAYOUTS))
    i = 0
    for dt, d, (lq, lk), masking in itertools.product(fc.DTYPES, fc.HEAD_DIMS, fc.SEQ_PAIRS, fc.MASKING):
        combos = rot if every_combination else [rot[(i * 7) % len(rot)]]
        i += 1
        for (hq, hkv), feature, layout in combos:
            yield dict(dtype=dt, d=d, lq=lq, lk=lk, masking=masking, hq=hq, hkv=hkv, feature=feature,
                       layout=layout, batch=1 if lq * lk > 20000 else 2, dlse=i % 3 == 0,
                       dbias=feature.startswith("bias"))


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--sample", type=int, default=0, help="run N sampled cases instead of the full matrix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every-combination", action="store_true")
    ap.add_argument("--shard", default="0/1", help="i/n: run every n-th case starting at i")
    ap.add_argument("--max-elems", type=int, default=0,
                    help="skip cases with B*Hq*Lq*Lk above this (0 = no limit)")
    ap.add_argument("--orders", default="forward,reverse")
    ap.add_argument("--unchecked", action="store_true", help="run without the race/bounds checks")
    ap.add_argument("--stop-on-fail", action="store_true")
    args = ap.parse_args()

    if args.sample:
        cases = fc.sample_cases(args.sample, args.seed, seq_pairs=fc.SEQ_PAIRS)
        for i, c in enumerate(cases):
            c["hq"], c["hkv"] = bk.GQA_BWD[i % len(bk.GQA_BWD)]
            c["dlse"] = i % 3 == 0
            c["dbias"] = c["feature"].startswith("bias")
    else:
        cases = full_matrix(args.every_combination)
    shard_i, shard_n = (int(x) for x in args.shard.split("/"))
    orders = tuple(args.orders.split(","))
    n_ok = n_fail = n_skip = 0
    t_start = time.time()
    failures = []
    for idx, case in enumerate(cases):
        if idx % shard_n != shard_i:
            continue
        size = case.get("batch", 1) * case["hq"] * case["lq"] * case["lk"]
        if args.max_elems and size > args.max_elems:
            n_skip += 1
            continue
        t0 = time.time()
        try:
            bk.run_and_check(case, orders=orders, checked=not args.unchecked)
            status = "ok"
            n_ok += 1
        except Exception as e:  # noqa: BLE001 - report every failure and go on
            status = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            n_fail += 1
            failures.append(bk.case_id(case))
            if args.stop_on_fail:
                traceback.print_exc()
        print(f"{idx:5d} {bk.case_id(case):70s} {time.time() - t0:7.2f}s {status}", flush=True)
        if status != "ok" and args.stop_on_fail:
            break
    print(f"\n{n_ok} ok, {n_fail} failed, {n_skip} skipped in {time.time() - t_start:.0f}s")
    for f in failures:
        print("failed:", f)
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
