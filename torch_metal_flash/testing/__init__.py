"""Judging attention results on a user's machine: what the doctor and the tuner's correctness
gate run (the case matrices the tests and benches share live in the repository's tests/support).

* :mod:`.oracle`: the acceptance rule against the float64 oracle and the
  machine-independent inputs (:func:`randn`); its names are this package's.
* :mod:`.flex_oracle`: FlexAttention's dense float64 definition (the doctor's flex probe).
* :mod:`.tuning_gate`: a forced variant checked against the oracle before the tuner keeps it.
* :func:`inject_faults`: kernels that fail to compile or to build their pipeline, on
  purpose (the doctor checks the fallback with it).
"""
from .faults import inject_faults
from .oracle import (FLOOR_ROUNDINGS, GRAD_NAMES, SATURATED, UNIT_ROUNDOFF, Arith, Attention, allowed_error,
                     assert_matches_oracle, backward_reference, check_backward, check_forward, error_budget,
                     forward_reference, generator_keep_mask, grad_errors, plain_attention, randn)

__all__ = [
    "FLOOR_ROUNDINGS", "GRAD_NAMES", "SATURATED", "UNIT_ROUNDOFF", "Arith", "Attention", "allowed_error",
    "assert_matches_oracle", "backward_reference", "check_backward", "check_forward", "error_budget",
    "forward_reference", "generator_keep_mask", "grad_errors", "inject_faults", "plain_attention", "randn",
]
