"""The neuron graph compiler behind `torch.compile(backend="neuron")` (see docs/compiler.md).

Importing this package is light (no Dynamo or Inductor): they load when a graph is compiled.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from ..runtime import patches


def _route_default_backend(done: patches.Applied) -> None:
    cls = torch._TorchCompileInductorWrapper
    inductor_call = cls.__call__

    def __call__(self: Any, model_: Any, inputs_: list, **kwargs: Any) -> Any:
        if any(isinstance(x, torch.Tensor) and x.device.type == "neuron" for x in inputs_):
            from .backend import neuron_backend

            return neuron_backend(model_, inputs_, options=self.config or None)
        return inductor_call(self, model_, inputs_, **kwargs)

    done.replace(cls, "__call__", functools.wraps(inductor_call)(__call__))


ROUTE_DEFAULT_BACKEND = patches.declare(
    "route-default-backend", "torch._TorchCompileInductorWrapper.__call__",
    "plain torch.compile(model) sends graphs whose inputs live on neuron to the neuron backend, others to Inductor",
    "tests/test_compile.py::test_plain_torch_compile_routes_neuron_graphs", _route_default_backend)


def route_default_backend() -> None:
    """Send plain `torch.compile(model)` (the default "inductor" backend) to the neuron backend when a graph's
    inputs live on `neuron`; graphs on other devices still go to Inductor unchanged. Idempotent."""
    patches.apply(ROUTE_DEFAULT_BACKEND)
