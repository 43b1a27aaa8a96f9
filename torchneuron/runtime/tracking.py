"""Op tracking: which ops ran natively on `neuron`, which ran as host fallbacks, and dtype-policy events.

The counters live in the C++ fallback (they cost a counter increment per op); these functions read them.
Names mirror AWS TorchNeuron's `torch_neuronx.get_executed_ops()` / `get_fallback_ops()` / `clear_op_tracking()`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import _C

# Calls that run a compiled kernel in place of its own run (fn(kernel, args) -> results), newest last: the hook
# through which torchneuron.profiler observes the compiler's kernels (compiler.kernel.Kernel calls them).
KERNEL_OBSERVERS: list[Callable[[Any, list], list]] = []


def get_executed_ops() -> dict[str, int]:
    """Ops the device ran natively since the last clear: {"aten::mm": 12, ...}."""
    return dict(_C._executed_ops())


def get_fallback_ops() -> dict[str, int]:
    """Ops that ran as host (CPU) fallbacks because the device does not declare them native."""
    return dict(_C._fallback_ops())


def get_dtype_events() -> dict[str, int]:
    """Dtype-rule events per op under TORCHNEURON_DTYPE_POLICY=trainium: float64 results or host values held to
    float32 precision, and int64 results outside the int32 range."""
    return dict(_C._dtype_events())


def get_fusion_counts() -> dict[str, int]:
    """Adaptive eager fusion since the last clear: {"kernels": fused kernels run, "ops": queued ops they ran}."""
    return dict(_C._fusion_counts())


def get_execution_paths() -> dict[str, int]:
    """How launches ran since the last clear, a count per path of docs/device.md's table (fast, now, host,
    first_call, queued_out, queued_each, queued_copy, kernel, compiled), and "fused": the queued ops a stream worker
    ran inside eager-fusion kernels (already counted under their queued path)."""
    return {**_C._execution_paths(), "fused": _C._fusion_counts()["ops"]}


def clear_op_tracking() -> None:
    """Reset all counters, and re-arm the once-per-op warnings."""
    _C._clear_op_tracking()
