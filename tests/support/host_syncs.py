"""A context in which every way of reading a tensor's values on the host raises: the
kernel paths must not synchronise (on MPS each read drains the GPU queue)."""
from __future__ import annotations

import contextlib

import torch

_SYNCING = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__array__")


@contextlib.contextmanager
def host_syncs_raise():
    """Every way of reading a tensor's values on the host raises (on MPS each one
    drains the GPU queue): item/tolist/bool/int/float/index, .cpu(), .numpy(),
    .to(<cpu>) and torch.equal."""
    def forbid(name):
        def raiser(*args, **kwargs):
            raise AssertionError(f"host synchronisation: Tensor.{name}")
        return raiser

    to = torch.Tensor.to

    def checked_to(self, *args, **kwargs):
        target = [a for a in args if isinstance(a, (str, torch.device))] + [kwargs.get("device")]
        if any(t is not None and torch.device(t).type == "cpu" for t in target):
            raise AssertionError("host synchronisation: Tensor.to(cpu)")
        return to(self, *args, **kwargs)

    saved = {name: torch.Tensor.__dict__.get(name) for name in _SYNCING + ("to",)}
    equal = torch.equal
    try:
        for name in _SYNCING:
            setattr(torch.Tensor, name, forbid(name))
        torch.Tensor.to = checked_to
        torch.equal = forbid("equal")
        yield
    finally:
        torch.equal = equal
        for name, fn in saved.items():
            if fn is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, fn)
