"""torch.distributed on `neuron`: the "neuron" c10d backend (gloo on zero-copy host views of device memory).

Importing this module registers the backend (torchneuron's autoload does it inside `import torch`), so
`init_process_group(backend="neuron")`, `init_process_group(device_id=torch.device("neuron", i))` and
`get_default_backend_for_device("neuron")` work. See docs/distributed.md.
"""
from __future__ import annotations

import torch.distributed as dist

from ..runtime import patches

__all__ = ["ProcessGroupNeuron", "register"]

if dist.is_available():
    from .process_group import ProcessGroupNeuron


def _register(done: patches.Applied) -> None:
    if dist.is_available() and "neuron" not in dist.Backend.backend_list:
        dist.Backend.register_backend("neuron", ProcessGroupNeuron.create, extended_api=True,
                                      devices=["neuron"])


C10D_BACKEND = patches.declare(
    "c10d-neuron-backend", "torch.distributed.Backend (backend list, device map: 'neuron' -> 'neuron')",
    "init_process_group('neuron') and device_id=neuron work, through c10d's register_backend extension API",
    "tests/test_distributed_backend.py::test_registered_for_the_neuron_device", _register,
    no_undo="torch.distributed has no way to unregister a backend")


def register() -> None:
    """Register the "neuron" backend with c10d once (a no-op where torch has no distributed support)."""
    patches.apply(C10D_BACKEND)


register()
