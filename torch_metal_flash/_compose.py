"""The composition root: every call that runs up the layers is wired here, once, as the package loads.

Each lower layer exposes a named slot for what it needs from above (the backends' run counts
and Metal plan runner, the C++ core's thread-choice mirror and native signature, the tuning
choice the planner asks, the emulator family change, the tuner's correctness gate); nothing
below this module fills a slot itself, so reading this file shows the whole upward wiring.
"""
import torch_metal_flash.backends as backends
import torch_metal_flash.backends.metal as metal
import torch_metal_flash.core as core
import torch_metal_flash.emulator.config as config
import torch_metal_flash.planner.choice as choice
import torch_metal_flash.problem.checks as checks
import torch_metal_flash.tuning as tuning


def _on_core_load(ext) -> None:
    # the C++ core mirrors each thread's backend choice and computes the problem signature natively
    backends.mirror_choice_to(ext.core.set_thread_backend)
    checks.use_native_signature(getattr(ext.core, "signature", None))


def _check_variant(op, problem, device):
    """The tuner's correctness gate (torch_metal_flash.testing.tuning_gate), imported when first used."""
    import torch_metal_flash.testing.tuning_gate as tuning_gate
    return tuning_gate.wrong_result(op, problem, device)


backends.count_runs_from(core.run_counts)
metal.run_plans_with(core.run_plan)
core.when_loaded(_on_core_load)
core.when_loaded(tuning.sync_core)
config.on_family_change(tuning._sync_family)
choice.install(tuning.planned)
tuning.install_result_check(_check_variant)
