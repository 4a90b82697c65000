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

Planners stay pure: ``pipeline_info`` is an argument, and ``None`` (no backend,
e.g. unit tests of a planner) means "no limits known": the first candidate.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional, Union

from .plan import Launch, Plan, Unsupported

PipelineInfo = Callable[[str, str, Mapping[int, Union[bool, int, float]]], Mapping[str, int]]


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


def plan_misfit(plan: Plan, pipeline_info: PipelineInfo) -> Optional[str]:
    """Why some launch of ``plan`` exceeds its pipeline's limits, or None."""
    for launch in plan.launches:
        why = launch_misfit(launch, pipeline_info(launch.source, launch.kernel, launch.function_constants))
        if why is not None:
            return why
    return None


def first_fitting(candidates: Iterable[Union[Plan, Unsupported]],
                  pipeline_info: Optional[PipelineInfo]) -> Union[Plan, Unsupported]:
    """The first candidate plan whose launches all fit (candidates are built lazily,
    most preferred first).  An :class:`Unsupported` candidate ends the search: its
    reason does not depend on the variant."""
    first_misfit = None
    for plan in candidates:
        if isinstance(plan, Unsupported) or pipeline_info is None:
            return plan
        why = plan_misfit(plan, pipeline_info)
        if why is None:
            return plan
        first_misfit = first_misfit or why
    if first_misfit is None:
        return Unsupported("no kernel variant for this configuration")
    return Unsupported(f"no kernel variant fits the pipeline limits: {first_misfit}")
