"""Suite-wide hooks.

* In CI (``CI`` set), a skipped test fails unless it is a macOS/MPS-only test:
  a missing compiler or optional dependency must not turn into a silent skip.
* The summary reports the time spent compiling kernels for the emulator.
* Every op call goes through the C++ op core (loaded, and built if needed, at
  session start) with the plan cache in verify mode: each cache hit re-plans
  and fails if the cached template differs (an incomplete cache key).
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TORCH_METAL_FLASH_PLAN_CACHE_VERIFY", "1")


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
    from torch_metal_flash import emulator
    seconds = emulator.compile_seconds()
    if seconds:
        terminalreporter.write_sep("-", f"{seconds:.1f} s compiling emulator kernels and the C++ op core "
                                        f"(this session)")
