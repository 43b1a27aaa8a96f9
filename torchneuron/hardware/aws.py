"""AWS's own TorchNeuron (the `torch-neuronx` distribution) next to ours: the rule that ours never shadows it.

Both claim the `neuron` device (PrivateUse1), the `neuron` c10d and torch.compile backends and the importable
module `torch_neuronx`. When AWS's distribution is installed, torchneuron stands down: it registers nothing,
its `torch_neuronx` refuses to import, and its torch.compile entry point hands graphs to AWS's (see
docs/ecosystem.md).
"""
from __future__ import annotations

import functools
import importlib.metadata as metadata
from typing import Any

DISTRIBUTION = "torch-neuronx"


@functools.cache
def installed() -> str | None:
    """The version of AWS's torch-neuronx distribution if it is installed, else None (a metadata lookup)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def stand_down_message() -> str:
    return (f"AWS's {DISTRIBUTION} {installed()} is installed: torchneuron stands down and leaves the `neuron` "
            "device, backends and the torch_neuronx module to it. To use torchneuron's modelled Trainium, "
            f"install it in an environment without {DISTRIBUTION} (pip uninstall {DISTRIBUTION}).")


def compile_backend() -> Any:
    """AWS's `neuron` torch.compile backend (its `torch_dynamo_backends` entry point)."""
    for ep in metadata.entry_points(group="torch_dynamo_backends", name="neuron"):
        if ep.dist is not None and ep.dist.metadata["Name"].replace("_", "-").lower() == DISTRIBUTION:
            return ep.load()
    raise RuntimeError(f"{stand_down_message()} Its distribution declares no `neuron` torch.compile backend.")
