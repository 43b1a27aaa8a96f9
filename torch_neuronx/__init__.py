"""AWS TorchNeuron's module name, provided by torchneuron: `import torch_neuronx` and its public names work.

Hugging Face transformers and accelerate detect a native `neuron` device by this module being importable
(`importlib.util.find_spec("torch_neuronx")`); scripts written from AWS's docs import it. Each name maps onto
torchneuron's implementation; a name of AWS's API that torchneuron does not provide raises AttributeError saying
what to use instead. When AWS's own torch-neuronx distribution is installed this module refuses to import rather
than shadow it (docs/ecosystem.md).
"""
from __future__ import annotations

from typing import Any

from torchneuron.hardware import aws as _aws

if _aws.installed():
    raise ImportError(f"this torch_neuronx is torchneuron's stand-in, and {_aws.stand_down_message()} Reinstall "
                      f"{_aws.DISTRIBUTION} (pip install --force-reinstall {_aws.DISTRIBUTION}) to restore its module.")

import torch  # noqa: E402

import torchneuron  # noqa: E402  (registers the device when TORCH_DEVICE_BACKEND_AUTOLOAD=0 kept torch from it)
from torchneuron import clear_op_tracking, get_executed_ops, get_fallback_ops  # noqa: E402

__version__ = torchneuron.__version__

# AWS's top-level names and where they live here (torch.neuron is the device module in both).
_DEVICE_NAMES = ("get_dynamo_metrics", "reset_dynamo_metrics", "synchronize", "is_available", "device_count",
                 "current_device", "set_device", "memory_stats", "memory_allocated", "max_memory_allocated",
                 "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
                 "reset_accumulated_memory_stats", "memory_summary", "empty_cache", "manual_seed",
                 "manual_seed_all")

# Names of AWS's API (native TorchNeuron and the earlier XLA-based torch-neuronx) that torchneuron does not
# provide, with what to use instead.
NOT_PROVIDED = {
    "trace": "torch.compile(model, backend='neuron') (tracing into a TorchScript module is XLA-era torch-neuronx)",
    "move_trace_to_device": "module.to('neuron') and torch.compile(model, backend='neuron')",
    "dynamic_batch": "torch.compile(model, backend='neuron'): each new batch size compiles its own graph",
    "async_load": "torch.compile(model, backend='neuron')",
    "lazy_load": "torch.compile(model, backend='neuron')",
    "replace_weights": "module.load_state_dict(...) on the compiled module's original",
    "analyze": "torchneuron.get_fallback_ops() after a run, or `torchneuron check` on the source",
    "DataParallel": "torch.nn.parallel.DistributedDataParallel under torchrun with init_process_group('neuron')",
    "partition": "torch.distributed (DTensor / FSDP2 / tensor parallel) over the 'neuron' backend",
    "PartitionerConfig": "torch.distributed (DTensor / FSDP2 / tensor parallel) over the 'neuron' backend",
    "xla": "the native `neuron` device: torch.device('neuron') (there is no XLA layer)",
    "xla_impl": "the native `neuron` device: torch.device('neuron') (there is no XLA layer)",
    "neuron_dynamo_backend": "torch.compile(model, backend='neuron', options={'model_name': name})",
    "set_model_name": "torch.compile(model, backend='neuron', options={'model_name': name})",
}


def __getattr__(name: str) -> Any:
    if name in _DEVICE_NAMES:
        return getattr(torch.neuron, name)
    if name == "nki_op":  # AWS's name for registering an NKI kernel as a custom op (docs/nki.md)
        from torchneuron.nki.torch_op import nki_op

        return nki_op
    if name in NOT_PROVIDED:
        raise AttributeError(f"torch_neuronx.{name} is not provided by torchneuron: use {NOT_PROVIDED[name]}")
    raise AttributeError(f"module 'torch_neuronx' (torchneuron's stand-in) has no attribute {name!r}: it provides "
                         f"{', '.join(sorted(__all__))}; the device module is torch.neuron")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = ["clear_op_tracking", "get_executed_ops", "get_fallback_ops", "nki_op", *_DEVICE_NAMES]
