"""Device selection and properties of `torch.neuron`, mirroring `torch.cuda`, and the backend registration."""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import torch

from .. import _C
from ..hardware import config as _config

_CONFIG: _config.Config | None = None
_device_t = torch.device | str | int | None


def config() -> _config.Config:
    """The modelled machine and policies this process runs with (read from the environment at registration)."""
    if _CONFIG is None:
        raise RuntimeError("torchneuron is not registered yet: import torchneuron (or torch with autoload on)")
    return _CONFIG


def _set_config(**changes: Any) -> None:
    global _CONFIG
    _CONFIG = dataclasses.replace(config(), **changes)


def register() -> None:
    """Make PrivateUse1 the `neuron` device: the C++ core, `torch.neuron`, and the generated methods."""
    global _CONFIG
    if _CONFIG is not None:
        return
    from ..runtime import policy

    cfg = _config.load()
    _C._init([cfg.core_capacity] * cfg.device_count)
    _CONFIG = cfg
    policy.install_op_tables()
    policy.set_policies()
    torch.utils.rename_privateuse1_backend("neuron")
    torch._register_device_module("neuron", sys.modules[__package__])  # torchneuron.device is torch.neuron
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)
    _keep_parameters_on_conversion()
    # Backward runs on the calling thread, as on the CPU. PyTorch gives each accelerator an autograd worker
    # thread so host and device work overlap; this device executes on the host synchronously, so that thread
    # only adds a hand-off (~190 us per backward call on a 2-core box). Thread-local: set for the importing
    # thread; torch.autograd.set_multithreading_enabled(True) restores PyTorch's default.
    torch.autograd.set_multithreading_enabled(False)
    if cfg.local_rank is not None:  # under torchrun each rank starts on its own logical core
        torch._C._accelerator_hooks_set_current_device(cfg.local_rank)


def _keep_parameters_on_conversion() -> None:
    """Make `module.to("neuron")` keep parameter identity and weight tying, as it does for CUDA.

    PyTorch swaps a parameter's data in place only between "dense" backends, a list that leaves PrivateUse1 out, so
    a plain `.to("neuron")` would make new Parameter objects: tied weights come apart and optimizers built before
    the move lose their parameters. Conversions that cross the neuron boundary use PyTorch's own tensor-swapping
    path (torch.__future__.set_swap_module_params_on_conversion) instead; all others are left untouched.
    """
    Module = torch.nn.Module

    def crosses(module: torch.nn.Module, target: torch.device | None) -> bool:
        if target is None:
            return False
        into = target.type == "neuron"
        return any((t.device.type == "neuron") != into for t in (*module.parameters(), *module.buffers()))

    def crossing(convert, target_of):
        @functools.wraps(convert)
        def wrapper(self, *args, **kwargs):
            if torch.__future__.get_swap_module_params_on_conversion() or not crosses(self, target_of(args, kwargs)):
                return convert(self, *args, **kwargs)
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                return convert(self, *args, **kwargs)
            finally:
                torch.__future__.set_swap_module_params_on_conversion(False)
        return wrapper

    Module.to = crossing(Module.to, lambda a, k: torch._C._nn._parse_to(*a, **k)[0])
    Module.cpu = crossing(Module.cpu, lambda a, k: torch.device("cpu"))
    Module.neuron = crossing(Module.neuron, lambda a, k: torch.device("neuron"))


def is_available() -> bool:
    return _CONFIG is not None and _CONFIG.device_count > 0


def is_initialized() -> bool:
    return _CONFIG is not None


def init() -> None:
    """Nothing to do: the modelled devices are ready at registration (kept for torch.cuda parity)."""


_lazy_init = init


def _is_in_bad_fork() -> bool:
    return False  # no driver state to lose across fork: device memory is host memory


def device_count() -> int:
    return config().device_count


def current_device() -> int:
    return torch._C._accelerator_hooks_get_current_device()


def _index(device: _device_t, optional: bool = True) -> int:
    if device is None:
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "neuron":
            raise ValueError(f"expected a neuron device, got {device}")
        return current_device() if device.index is None else device.index
    if isinstance(device, int):
        return device
    raise TypeError(f"expected a neuron device (torch.device, str or int), got {type(device).__name__}")


def set_device(device: _device_t) -> None:
    idx = _index(device)
    if idx >= 0:
        torch._C._accelerator_hooks_set_current_device(idx)


class device:
    """Context manager that changes the current neuron device, like `torch.cuda.device`."""

    def __init__(self, device: _device_t):
        self.idx = _index(device)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = torch._C._accelerator_hooks_exchange_device(self.idx)

    def __exit__(self, *exc: Any) -> bool:
        torch._C._accelerator_hooks_set_current_device(self.prev)
        return False


class device_of(device):
    """Context manager that makes the device of a tensor current, like `torch.cuda.device_of`."""

    def __init__(self, obj: torch.Tensor):
        super().__init__(obj.get_device() if obj.is_neuron else -1)

    def __enter__(self) -> None:
        if self.idx >= 0:
            super().__enter__()

    def __exit__(self, *exc: Any) -> bool:
        return super().__exit__() if self.idx >= 0 else False


@dataclasses.dataclass(frozen=True)
class NeuronDeviceProperties:
    """What `get_device_properties` reports: the logical NeuronCore and the chip it belongs to."""

    name: str
    total_memory: int
    core_version: str
    logical_core: int  # global logical-core id on the instance
    physical_cores: int  # physical NeuronCores behind this logical core (the LNC setting)
    chip_index: int
    chip: str
    instance: str
    cores_per_chip: int

    def __repr__(self) -> str:
        return (f"NeuronDeviceProperties(name='{self.name}', total_memory={self.total_memory >> 20}MB, "
                f"core={self.core_version}, logical_core={self.logical_core}, lnc={self.physical_cores}, "
                f"chip={self.chip_index} ({self.chip}), instance={self.instance})")


def _invalid_device_message(idx: int) -> str:
    return (f"neuron error: invalid device ordinal {idx}: this process sees {device_count()} neuron device(s), "
            f"valid indices are 0..{device_count() - 1} (see NEURON_RT_VISIBLE_CORES and TORCHNEURON_INSTANCE)")


def _checked(device: _device_t) -> int:
    """The device's index; an invalid one raises torch.AcceleratorError (a RuntimeError), as CUDA's calls do."""
    idx = _index(device)
    if not 0 <= idx < device_count():
        raise torch.AcceleratorError(_invalid_device_message(idx))
    return idx


def get_device_properties(device: _device_t = None) -> NeuronDeviceProperties:
    idx = _index(device)
    if not 0 <= idx < device_count():  # torch.cuda.get_device_properties raises AssertionError("Invalid device id")
        raise AssertionError(f"Invalid device id: {_invalid_device_message(idx)}")
    cfg = config()
    core = cfg.visible_cores[idx]
    return NeuronDeviceProperties(
        name=f"{cfg.chip.name} {cfg.chip.core_version} (modelled)", total_memory=cfg.core_capacity,
        core_version=cfg.chip.core_version, logical_core=core, physical_cores=cfg.lnc,
        chip_index=core // cfg.cores_per_chip, chip=cfg.chip.name, instance=cfg.instance.name,
        cores_per_chip=cfg.cores_per_chip)


def get_device_name(device: _device_t = None) -> str:
    return get_device_properties(device).name


def get_device_capability(device: _device_t = None) -> tuple[int, int]:
    """The NeuronCore version as (major, 0): v2 on trn1, v3 on trn2, v4 on trn3."""
    get_device_properties(device)  # validates the index as CUDA does
    return int(config().chip.core_version.rsplit("v", 1)[1]), 0


def synchronize(device: _device_t = None) -> None:
    """Wait for all work on the device: ops run to completion when issued, so this only validates the device."""
    torch._C._accelerator_synchronizeDevice(_checked(device))


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float32, torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_dynamo_metrics() -> list[dict]:
    """Per-graph compile metrics of `torch.compile(backend="neuron")` (AWS TorchNeuron's name)."""
    from ..compiler import metrics

    return metrics.get()


def reset_dynamo_metrics() -> None:
    from ..compiler import metrics

    metrics.reset()
