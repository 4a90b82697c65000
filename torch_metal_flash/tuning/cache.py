"""The tuning cache: the winners ``tune`` measured, one JSON file per GPU.

Location: ``TORCH_METAL_FLASH_TUNING_CACHE`` (a file name), else
``~/.cache/torch_metal_flash/tuning/<GPU name>.json``.  Each entry holds the
machine it was measured on (GPU name, OS version, package version, torch
version: torch's own kernels, timed as the stock route, change between
releases) and the problem class (op, part, dtype, head dims, feature class,
sequence-length class).  Entries of another machine, package or torch version
are stale and ignored; a file that cannot be read or parsed is ignored as a whole.  Either
way one warning per file says so and the family defaults apply: a cache can
make a call slower, never wrong (every variant is verified) nor crash it.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import re
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

from .._paths import VERSION

ENV = "TORCH_METAL_FLASH_TUNING_CACHE"
FORMAT = 1
_SEQ_CLASSES = (256, 1024, 4096, 16384)


class TuningCacheWarning(UserWarning):
    """The tuning cache was unreadable or stale; the family defaults apply."""


def seq_class(seqlen_q: int, seqlen_k: int) -> str:
    """The sequence-length class of a problem: each length rounded up to 256, 1K, 4K, 16K or more."""
    def one(n: int) -> str:
        for bound in _SEQ_CLASSES:
            if n <= bound:
                return f"{bound // 1024}K" if bound >= 1024 else str(bound)
        return "more"
    return f"q{one(int(seqlen_q))}_k{one(int(seqlen_k))}"


def feature_class(causal: bool, features: dict) -> str:
    on = sorted(name for name, value in features.items() if value)
    return "+".join(["causal" if causal else "full", *on])


@functools.lru_cache(maxsize=None)
def gpu_name(family: str) -> str:
    """The device the choices are made for: the Mac's chip, else the emulator and its family."""
    if sys.platform == "darwin":
        from ..backends.metal import chip_name
        return chip_name()
    return f"emulator-{family}"


def os_version() -> str:
    return f"macOS {platform.mac_ver()[0]}" if sys.platform == "darwin" else platform.system()


def package_version() -> str:
    return VERSION


def torch_version() -> str:
    import torch
    return torch.__version__


def default_path(gpu: str) -> Path:
    env = os.environ.get(ENV, "").strip()
    if env:
        return Path(env).expanduser()
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", gpu).strip("_") or "gpu"
    return Path.home() / ".cache" / "torch_metal_flash" / "tuning" / f"{safe}.json"


class Cache:
    """The entries of one cache file that belong to this machine, keyed by problem class."""

    def __init__(self, path: Path, gpu: str):
        self.path = Path(path)
        self.gpu = gpu
        self.entries: dict[tuple, dict] = {}  # ours
        self.foreign: list[dict] = []  # other machines' (kept when the file is rewritten)
        self._load()

    def machine(self) -> dict:
        return {"gpu": self.gpu, "os": os_version(), "package": package_version(), "torch": torch_version()}

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
                raise ValueError(f"not a format-{FORMAT} tuning cache")
            me = self.machine()
            stale = 0
            for e in data["entries"]:
                if not isinstance(e, dict) or not isinstance(e.get("variant"), str):
                    raise ValueError("an entry without a variant")
                if all(e.get(k) == v for k, v in me.items()):
                    self.entries[key_of(e)] = e
                else:
                    self.foreign.append(e)
                    stale += 1
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.entries, self.foreign = {}, []
            _warn(f"torch_metal_flash: ignoring the tuning cache {self.path} ({exc}); the family defaults apply. "
                  f"Re-run `python -m torch_metal_flash tune` or delete the file.")
            return
        if stale and not self.entries:
            _warn(f"torch_metal_flash: the tuning cache {self.path} was measured on another GPU, OS, package or "
                  f"torch version ({stale} entries); the family defaults apply. "
                  f"Re-run `python -m torch_metal_flash tune`.")

    def get(self, key: tuple) -> Optional[dict]:
        return self.entries.get(key)

    def put(self, entry: dict) -> None:
        entry = {**self.machine(), **entry}
        self.entries[key_of(entry)] = entry

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": FORMAT, "entries": self.foreign + list(self.entries.values())}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)  # concurrent writers: the last whole file wins


_KEY = ("op", "part", "dtype", "head_dim", "head_dim_v", "features", "seq")


def key_of(entry: dict) -> tuple:
    return tuple(entry[k] for k in _KEY)


def make_key(op, part, dtype_name, head_dim, head_dim_v, features, seq) -> tuple:
    return (op, part, dtype_name, int(head_dim), int(head_dim_v), features, seq)


_warned: set = set()
_warned_lock = threading.Lock()


def _warn(message: str) -> None:
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, TuningCacheWarning, stacklevel=4)
