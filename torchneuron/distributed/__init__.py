"""torch.distributed on `neuron`: the "neuron" c10d backend (gloo on zero-copy host views of device memory).

Importing this module registers the backend (torchneuron's autoload does it inside `import torch`), so
`init_process_group(backend="neuron")`, `init_process_group(device_id=torch.device("neuron", i))` and
`get_default_backend_for_device("neuron")` work. See docs/distributed.md.
"""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["ProcessGroupNeuron", "register"]

if dist.is_available():
    from .process_group import ProcessGroupNeuron


def register() -> None:
    """Register the "neuron" backend with c10d once (a no-op where torch has no distributed support)."""
    if dist.is_available() and "neuron" not in dist.Backend.backend_list:
        dist.Backend.register_backend("neuron", ProcessGroupNeuron.create, extended_api=True,
                                      devices=["neuron"])


register()
