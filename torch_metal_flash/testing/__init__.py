"""Judging attention results, and the problems the tests and the benches share.

* :mod:`.oracle`: the acceptance rule against the float64 oracle and the
  machine-independent inputs (:func:`randn`); its names are this package's.
* Case matrices and problem builders, imported by name so that importing
  this package stays light: ``forward_cases``, ``backward_cases``,
  ``precision_cases``, ``varlen_cases``, ``kvcache_cases`` (with the independent
  float64 implementation ``kvcache_oracle``), ``ring_cases`` (ring attention's problems and
  a process group of spawned gloo processes to run them), ``fuzz_problems`` (whole problems
  of every face; needs hypothesis, a test dependency) and ``portable``
  (``torch.randn_like`` / ``Tensor.normal_`` through :func:`randn`).
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
