"""Pipeline limits, checked before anything is encoded.

Apple's compiler lowers a pipeline's ``maxTotalThreadsPerThreadgroup`` below
1024 for register-heavy kernels, and threadgroup memory (static plus dynamic)
is bounded per device.  A launch that exceeds either cannot run, and finding
out at launch time would leave the earlier launches of its plan encoded.  So
the planners take the backend's ``pipeline_info(source, kernel,
function_constants)`` (cached by the backend; keys as in TEAM.md), try their
candidate variants in order of preference and keep the first plan whose every
launch fits, or return :class:`~torch_metal_flash.planner.plan.Unsupported` (the op
then falls back with the one-time warning).

A kernel that cannot be built at all -- its library fails to compile, or its
function or pipeline fails to build (a macOS or Xcode release whose compiler
rejects it) -- is one that does not fit either: ``pipeline_info`` raises
:class:`KernelBuildError` (the backend remembers it for the process), and the
planners try the next variant.

Planners stay pure: ``pipeline_info`` is an argument, and ``None`` (no backend,
e.g. unit tests of a planner) means "no limits known": the first candidate.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional, Union

from .plan import Launch, Plan, Unsupported

PipelineInfo = Callable[[str, str, Mapping[int, Union[bool, int, float]]], Mapping[str, int]]

STAGES = {"compile": "failed to compile", "function": "failed to specialise", "pipeline": "failed to build its pipeline"}


class KernelBuildError(RuntimeError):
    """A kernel that cannot be built on this backend: at ``stage`` "compile" (its library), "function"
    (specialising it) or "pipeline" (its pipeline state), with the compiler's ``message``."""

    def __init__(self, kernel: str, stage: str, message: str):
        self.kernel, self.stage, self.message = kernel, stage, message
        super().__init__(f"kernel {kernel} {STAGES[stage]}: {message}")

    @property
    def reason(self) -> str:
        """One line: the kernel, the stage and the first line of the compiler's message."""
        first = next((line.strip() for line in self.message.splitlines() if line.strip()), "(no message)")
        return f"kernel {self.kernel} {STAGES[self.stage]}: {first}"


def launch_misfit(launch: Launch, info: Mapping[str, int]) -> Optional[str]:
    """Why ``launch`` exceeds its pipeline's limits ``info``, or None."""
    threads = launch.threadgroup[0] * launch.threadgroup[1] * launch.threadgroup[2]
    limit = info["max_total_threads_per_threadgroup"]
    if threads > limit:
        return (f"kernel {launch.kernel} needs {threads} threads per threadgroup, its pipeline allows {limit} "
                f"on this GPU")
    static = info["static_threadgroup_memory_length"]
    memory = static + sum(-(-n // 16) * 16 for n in launch.threadgroup_memory.values())
    if memory > info["max_threadgroup_memory_length"]:
        return (f"kernel {launch.kernel} needs {memory} bytes of threadgroup memory ({static} static), "
                f"this GPU allows {info['max_threadgroup_memory_length']}")
    return None


def _why_not(plan: Plan, pipeline_info: PipelineInfo) -> tuple[Optional[str], bool]:
    """(why some launch of ``plan`` cannot run, or None; whether because its kernel cannot be built)."""
    for launch in plan.launches:
        try:
            info = pipeline_info(launch.source, launch.kernel, launch.function_constants)
        except KernelBuildError as e:
            return e.reason, True
        why = launch_misfit(launch, info)
        if why is not None:
            return why, False
    return None, False


def plan_misfit(plan: Plan, pipeline_info: PipelineInfo) -> Optional[str]:
    """Why some launch of ``plan`` cannot run -- its kernel cannot be built, or it exceeds its
    pipeline's limits -- or None."""
    return _why_not(plan, pipeline_info)[0]


def first_fitting(candidates: Iterable[Union[Plan, Unsupported]],
                  pipeline_info: Optional[PipelineInfo]) -> Union[Plan, Unsupported]:
    """The first candidate plan whose launches all fit (candidates are built lazily,
    most preferred first).  An :class:`Unsupported` candidate ends the search: its
    reason does not depend on the variant."""
    misfit = unbuilt = None
    for plan in candidates:
        if isinstance(plan, Unsupported) or pipeline_info is None:
            return plan
        why, cannot_build = _why_not(plan, pipeline_info)
        if why is None:
            return plan
        if cannot_build:
            unbuilt = unbuilt or why
        else:
            misfit = misfit or why
    if unbuilt is not None:  # a kernel that cannot be built says more than another variant's limits
        return Unsupported(f"no kernel variant can run here: {unbuilt}")
    if misfit is None:
        return Unsupported("no kernel variant for this configuration")
    return Unsupported(f"no kernel variant fits the pipeline limits: {misfit}")
