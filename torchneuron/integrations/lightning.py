"""PyTorch Lightning (`lightning` and `pytorch_lightning` / `lightning_fabric`) learns the `neuron` accelerator.

Lightning has no extension point for an outside accelerator name or for `accelerator="auto"`, so this is a patch,
applied by the import hook in `torchneuron.integrations` right after Lightning's own modules execute:
- a `NeuronAccelerator` is registered as "neuron" in Lightning's accelerator registries (Trainer and Fabric);
- the connectors' `accelerator="auto"` choice becomes "neuron" where it would have been "cpu";
- one neuron device gets a SingleDeviceStrategy on that device (Lightning would put it on "cpu");
- "16-mixed"/"bf16-mixed" autocast on "neuron" (Lightning would pick "cuda", which leaves neuron ops in fp32);
- DDP wraps a neuron module with device_ids=None (Lightning would open a torch.cuda.stream for any device ids).
DDP needs nothing: Lightning takes the process-group backend from torch.distributed's device map ("neuron").
Every change is recorded under the registry's "lightning-accelerator" patch (torchneuron.runtime.patches), and
`torchneuron.integrations.uninstall()` reverts it.
"""
from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..runtime import patches

PATCH = "lightning-accelerator"  # the registry entry (declared in torchneuron.integrations) these changes belong to
# (fabric package, pytorch package) of each distribution of Lightning
FLAVORS = (("lightning.fabric", "lightning.pytorch"), ("lightning_fabric", "pytorch_lightning"))
_UNDO: list[Callable[[], None]] = []  # what is not an attribute: the accelerator registries' "neuron" entries


def _device_ids(devices: Any) -> list[int]:
    """Lightning's `devices=` (int, "auto", -1, "0,1", [0, 1]) as neuron device indices, checked."""
    count = torch.neuron.device_count()
    if devices in ("auto", -1, "-1", None):
        return list(range(count))
    if isinstance(devices, str):
        devices = devices.strip()
        devices = int(devices) if devices.isdigit() else [int(d) for d in devices.split(",") if d.strip()]
    ids = list(range(devices)) if isinstance(devices, int) else list(devices)
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < count]
    if not ids or bad:
        raise ValueError(f"devices={devices!r}: this process sees {count} neuron device(s) (indices 0..{count - 1})")
    return ids


class _NeuronAccelerator:
    """Lightning's Accelerator interface on torch.neuron (mixed into Lightning's own Accelerator base class)."""

    def setup_device(self, device: torch.device) -> None:
        if device.type != "neuron":
            raise ValueError(f"the neuron accelerator got device {device}, expected a neuron device")
        torch.neuron.set_device(device)

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return torch.neuron.memory_stats(device)

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        return _device_ids(devices)

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("neuron", i) for i in _device_ids(devices)]

    @staticmethod
    def auto_device_count() -> int:
        return torch.neuron.device_count()

    @staticmethod
    def is_available() -> bool:
        return torch.neuron.is_available()

    @staticmethod
    def name() -> str:
        return "neuron"

    @classmethod
    def register_accelerators(cls, registry: Any) -> None:
        registry.register("neuron", cls, description="torchneuron's modelled Trainium NeuronCore")


def _is_neuron(flag: Any) -> bool:
    return flag == "neuron" or isinstance(flag, _NeuronAccelerator)


def _set(owner: Any, name: str, value: Any) -> None:
    """Replace `owner.name` (its own, not an inherited one), recorded so that undoing the patch puts it back."""
    if name not in vars(owner):
        raise AttributeError(f"{owner.__qualname__}.{name} is not defined there")
    patches.applied(PATCH).replace(owner, name, value)


def _register(module: ModuleType, registry_name: str) -> None:
    """After `<pkg>.accelerators` ran: register a NeuronAccelerator built on that package's Accelerator."""
    cls = type("NeuronAccelerator", (_NeuronAccelerator, module.Accelerator), {"__module__": __name__})
    registry = getattr(module, registry_name)
    cls.register_accelerators(registry)
    _UNDO.append(lambda: registry.pop("neuron", None))


def _patch_connector(module: ModuleType, connector_name: str, precision_attr: str) -> None:
    """After a connector module ran: "auto" may pick neuron, one device stays on it, mixed precision targets it."""
    cls = getattr(module, connector_name)
    choose_auto = cls.__dict__["_choose_auto_accelerator"].__func__
    choose_strategy, init_precision = cls._choose_strategy, cls._check_and_init_precision

    def _choose_auto_accelerator() -> str:
        choice = choose_auto()
        return "neuron" if choice == "cpu" and torch.neuron.is_available() else choice

    def _choose_strategy(self: Any) -> Any:
        if _is_neuron(self._accelerator_flag) and self._num_nodes_flag <= 1 and len(self._parallel_devices) <= 1:
            return module.SingleDeviceStrategy(device=self._parallel_devices[0])
        return choose_strategy(self)

    def _check_and_init_precision(self: Any) -> Any:
        if not _is_neuron(self._accelerator_flag) or getattr(self, precision_attr) not in ("16-mixed", "bf16-mixed"):
            return init_precision(self)
        mixed = module.MixedPrecision  # Lightning builds MixedPrecision(precision, device="cuda"): target neuron

        def on_neuron(precision: Any, device: Any = None, **kwargs: Any) -> Any:
            return mixed(precision, "neuron", **kwargs)
        with patches.swapped(module, "MixedPrecision", on_neuron):
            return init_precision(self)

    _set(cls, "_choose_auto_accelerator", staticmethod(_choose_auto_accelerator))
    _set(cls, "_choose_strategy", _choose_strategy)
    _set(cls, "_check_and_init_precision", _check_and_init_precision)


def _patch_ddp(module: ModuleType, method: str) -> None:
    """After a DDP strategy module ran: DDP on neuron gets device_ids=None (the module's one device), because
    Lightning wraps any other device_ids in torch.cuda.stream(...)."""
    cls = module.DDPStrategy
    device_ids = getattr(cls, method)

    def determine(self: Any) -> list[int] | None:
        return None if self.root_device.type == "neuron" else device_ids(self)

    _set(cls, method, determine)


def module_patches() -> dict[str, Callable[[ModuleType], None]]:
    """Module name -> what to do right after that Lightning module has executed."""
    out: dict[str, Callable[[ModuleType], None]] = {}
    for fabric, pytorch in FLAVORS:
        out[f"{fabric}.accelerators"] = lambda m: _register(m, "ACCELERATOR_REGISTRY")
        out[f"{pytorch}.accelerators"] = lambda m: _register(m, "AcceleratorRegistry")
        out[f"{fabric}.connector"] = lambda m: _patch_connector(m, "_Connector", "_precision_input")
        out[f"{pytorch}.trainer.connectors.accelerator_connector"] = (
            lambda m: _patch_connector(m, "_AcceleratorConnector", "_precision_flag"))
        out[f"{fabric}.strategies.ddp"] = lambda m: _patch_ddp(m, "_determine_ddp_device_ids")
        out[f"{pytorch}.strategies.ddp"] = lambda m: _patch_ddp(m, "determine_ddp_device_ids")
    return out


def undo() -> None:
    while _UNDO:
        _UNDO.pop()()
