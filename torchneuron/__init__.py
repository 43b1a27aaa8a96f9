"""torchneuron: a native PyTorch `neuron` device on a software model of a Trainium NeuronCore, plus migration
tools off CUDA and a Trainium performance and cost model.

Importing this package (or `import torch`, through the `torch.backends` autoload entry point) registers the
device. It stays light: the compiler, profiler, cost model and migration tools load on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

from . import _C  # noqa: F401  (the C++ core: allocator, guard, hooks, fallback, kernels, autocast)
from .device import module as _module
from .runtime.policy import set_policies
from .runtime.tracking import clear_op_tracking, get_dtype_events, get_executed_ops, get_fallback_ops

__version__ = "0.1.0"
__all__ = ["clear_op_tracking", "get_dtype_events", "get_executed_ops", "get_fallback_ops", "set_policies",
           "estimate", "profiler"]

_module.register()


def _autoload() -> None:
    """Entry point of the `torch.backends` group: importing the package already registered the device."""


_LAZY = {"estimate": ("torchneuron.costmodel.estimate", "estimate"), "profiler": ("torchneuron.profiler", None)}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        m = importlib.import_module(mod)
        return getattr(m, attr) if attr else m
    raise AttributeError(f"module 'torchneuron' has no attribute {name!r}")
