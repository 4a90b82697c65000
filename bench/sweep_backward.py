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

import harness

from support import backward_cases as bk
from support import forward_cases as fc


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
    args = harness.sweep_parser(__doc__).parse_args()
    if args.sample:
        cases = fc.sample_cases(args.sample, args.seed, seq_pairs=fc.SEQ_PAIRS)
        for i, c in enumerate(cases):
            c["hq"], c["hkv"] = bk.GQA_BWD[i % len(bk.GQA_BWD)]
            c["dlse"] = i % 3 == 0
            c["dbias"] = c["feature"].startswith("bias")
    else:
        cases = full_matrix(args.every_combination)
    return harness.sweep(cases, bk.run_and_check, bk.case_id, args)


if __name__ == "__main__":
    sys.exit(main())
