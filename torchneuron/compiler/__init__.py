"""The neuron graph compiler behind `torch.compile(backend="neuron")` (see docs/compiler.md).

Importing this package is light (no Dynamo or Inductor): they load when a graph is compiled.
"""
from __future__ import annotations

from typing import Any

import torch


def route_default_backend() -> None:
    """Send plain `torch.compile(model)` (the default "inductor" backend) to the neuron backend when a graph's
    inputs live on `neuron`; graphs on other devices still go to Inductor unchanged. Idempotent."""
    cls = torch._TorchCompileInductorWrapper
    if getattr(cls.__call__, "_neuron_routed", False):
        return
    inductor_call = cls.__call__

    def __call__(self: Any, model_: Any, inputs_: list, **kwargs: Any) -> Any:
        if any(isinstance(x, torch.Tensor) and x.device.type == "neuron" for x in inputs_):
            from .backend import neuron_backend

            return neuron_backend(model_, inputs_, options=self.config or None)
        return inductor_call(self, model_, inputs_, **kwargs)

    __call__._neuron_routed = True  # type: ignore[attr-defined]
    cls.__call__ = __call__
