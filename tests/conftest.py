"""Suite-wide hooks.

* Every test sees the same inputs on every machine, whatever ran before it:
  the global RNGs are seeded from the test's id, and ``torch.randn``,
  ``torch.randn_like`` and ``Tensor.normal_`` draw through
  :func:`torch_metal_flash.testing.randn` (``torch.randn``'s own bits depend on
  the CPU: its AVX2/AVX-512 path and its scalar path differ).
* torch.compile's caches live in a directory of this session: Inductor's
  shared ``/tmp/torchinductor_<user>`` would hand over graphs compiled against
  another version of the ops' schemas (its cache key does not cover custom-op
  schemas), so a test's verdict would depend on what ran on the machine before.
* In CI (``CI`` set), a skipped test fails unless it is a macOS/MPS-only test:
  a missing compiler or optional dependency must not turn into a silent skip.
* The summary reports the time spent compiling kernels for the emulator.
* Every op call goes through the C++ op core (loaded, and built if needed, at
  session start) with the plan cache in verify mode: each cache hit re-plans
  and fails if the cached template differs (an incomplete cache key).
* Hypothesis profiles of the property tests (tests/core/test_fuzz.py): "ci" (default)
  and "long"; after a long run the summary goes to bench/results/fuzz.md.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
import zlib

import pytest
from hypothesis import HealthCheck, settings

# Property-based tests (tests/core/test_fuzz.py).  "ci": bounded and derandomized (the same
# cases on every run and machine, no example database); "long": the shakedown run,
# ``pytest -m fuzz --hypothesis-profile=long`` (>= 10,000 cases over the faces).
_FUZZ = dict(deadline=None, print_blob=True,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=40, derandomize=True, database=None, **_FUZZ)
settings.register_profile("long", max_examples=1120, **_FUZZ)
settings.load_profile(os.environ.get("TORCH_METAL_FLASH_HYPOTHESIS_PROFILE", "ci"))
_SESSION_START = time.time()


def _commit() -> str:
    """The checkout's commit (for the fuzz summary), taken when the session starts."""
    try:
        return subprocess.run(["git", "-C", os.path.dirname(__file__), "describe", "--always", "--dirty"],
                              capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown (no git)"


_SESSION_COMMIT = _commit()

_INDUCTOR_CACHE = tempfile.TemporaryDirectory(prefix="tmf-tests-inductor-")  # removed at exit
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _INDUCTOR_CACHE.name)

os.environ.setdefault("TORCH_METAL_FLASH_PLAN_CACHE_VERIFY", "1")

import torch  # noqa: E402

from support.portable import normal_ as _normal_, randn_like as _randn_like  # noqa: E402
from torch_metal_flash.testing import randn as _portable_randn  # noqa: E402


@pytest.fixture(autouse=True)
def _portable_inputs(request, monkeypatch):
    # keyed by file name and test id, not folder: moving a file between folders keeps its inputs
    path, _, test = request.node.nodeid.partition("::")
    seed = zlib.crc32(f"{os.path.basename(path)}::{test}".encode())
    torch.manual_seed(seed)
    random.seed(seed)
    monkeypatch.setattr(torch, "randn", _portable_randn)
    monkeypatch.setattr(torch, "randn_like", _randn_like)
    monkeypatch.setattr(torch.Tensor, "normal_", _normal_)


@pytest.fixture
def launched(monkeypatch):
    """The kernel names of every emulator launch made while the test runs."""
    from torch_metal_flash.backends.emulator import EmulatorBackend
    names = []
    encode = EmulatorBackend.encode

    def recording_encode(self, launches):
        names.extend(prepared[1] for prepared, _ in launches)  # prepared: (source, kernel, ...)
        encode(self, launches)

    monkeypatch.setattr(EmulatorBackend, "encode", recording_encode)
    return names


def pytest_configure(config):
    from torch_metal_flash import core
    core.load()


_MAC_ONLY_WORDS = ("mps", "macos", "apple gpu")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if not any(word in reason.lower() for word in _MAC_ONLY_WORDS):
            report.outcome = "failed"
            report.longrepr = f"skipped in CI, where only macOS/MPS tests may skip: {reason}"


def pytest_terminal_summary(terminalreporter):
    _write_fuzz_summary(terminalreporter)
    from torch_metal_flash import emulator
    seconds = emulator.compile_seconds()
    if seconds:
        terminalreporter.write_sep("-", f"{seconds:.1f} s compiling emulator kernels and the C++ op core "
                                        f"(this session)")


def _write_fuzz_summary(terminalreporter) -> None:
    """After a run of the long profile, record its summary in bench/results/fuzz.md."""
    fuzz = sys.modules.get("test_fuzz")
    if settings._current_profile != "long" or fuzz is None or not fuzz.STATS:
        return
    stats = fuzz.STATS
    cases = sum(s["cases"] for s in stats.values())
    failed_tests = len(terminalreporter.stats.get("failed", []))
    root = os.path.join(os.path.dirname(__file__), "..")
    lines = ["# Property-based fuzz run (long profile)", "",
             "Command: `python -m pytest tests/core/test_fuzz.py -m fuzz --hypothesis-profile=long -q`", "",
             f"- commit: {_SESSION_COMMIT} (at the start); {os.cpu_count()} cores, torch {torch.__version__}, "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
             f"- cases: {cases} over {len(stats)} faces (a case that fails counts its shrinking replays too)",
             f"- failing cases: {sum(s['failed'] for s in stats.values())} (failed tests: {failed_tests})",
             f"- time: {time.time() - _SESSION_START:.0f} s wall-clock", "",
             "| face | cases | failing cases | seconds |", "|---|---|---|---|"]
    lines += [f"| {face} | {s['cases']} | {s['failed']} | {s['seconds']:.0f} |" for face, s in stats.items()]
    out = os.path.join(root, "bench", "results", "fuzz.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    terminalreporter.write_sep("-", f"fuzz summary written to {os.path.normpath(out)}")
