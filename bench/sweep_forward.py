"""Full forward kernel sweep in the emulator (the matrix of torch_metal_flash/testing/forward_cases.py).

The CI test (tests/kernels/test_forward_kernels.py) runs a fixed-seed sample of this
matrix; this script runs all of it (or a slice), each case in checked mode and
two schedule orders, and prints one line per case plus a summary.

    python bench/sweep_forward.py                 # 1,728 cases: dtype x head dim x lengths x masking
    python bench/sweep_forward.py --every-combination   # x GQA x features x layouts (165,888)
    python bench/sweep_forward.py --max-elems 20000 --shard 0/4
    python bench/sweep_forward.py --sample 500 --seed 1
"""
from __future__ import annotations

import sys
import time
import traceback

import harness

from torch_metal_flash.testing import forward_cases as fc


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
    else:
        cases = fc.full_matrix(args.every_combination)
    shard_i, shard_n = (int(x) for x in args.shard.split("/"))
    orders = tuple(args.orders.split(","))
    n_ok = n_fail = n_skip = 0
    t_start = time.time()
    for idx, case in enumerate(cases):
        if idx % shard_n != shard_i:
            continue
        size = case.get("batch", 1) * case["hq"] * case["lq"] * case["lk"]
        if args.max_elems and size > args.max_elems:
            n_skip += 1
            continue
        t0 = time.time()
        try:
            fc.run_and_check(case, orders=orders, checked=not args.unchecked)
            status = "ok"
            n_ok += 1
        except Exception as e:  # noqa: BLE001 - report every failure and go on
            status = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            n_fail += 1
            if args.stop_on_fail:
                traceback.print_exc()
        print(f"{idx:6d} {fc.case_id(case):70s} {time.time() - t0:7.2f}s {status}", flush=True)
        if status != "ok" and args.stop_on_fail:
            break
    print(f"\n{n_ok} ok, {n_fail} failed, {n_skip} skipped (size) in {time.time() - t_start:.0f}s")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
