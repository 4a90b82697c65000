"""Full forward kernel sweep in the emulator (the matrix of tests/support/forward_cases.py).

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

import harness

from support import forward_cases as fc


def main() -> int:
    args = harness.sweep_parser(__doc__).parse_args()
    if args.sample:
        cases = fc.sample_cases(args.sample, args.seed, seq_pairs=fc.SEQ_PAIRS)
    else:
        cases = fc.full_matrix(args.every_combination)
    return harness.sweep(cases, fc.run_and_check, fc.case_id, args)


if __name__ == "__main__":
    sys.exit(main())
