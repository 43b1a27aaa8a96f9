"""`torch.neuron.FloatStorage` & co: the legacy typed-storage classes of the device, as torch.cuda defines them.

PyTorch finds a storage's legacy class (`Tensor.storage_type()`, `TypedStorage.type()`, `isinstance(s,
torch.neuron.FloatStorage)`) by name in the device's module (`torch.neuron`) and reads the device from the class's
`__module__`, so the classes live under that name. One class per dtype that has a legacy name, except the quantized
ones, which the device cannot hold (as torch.cuda).
"""
from __future__ import annotations

import torch
from torch._utils import classproperty
from torch.storage import _LegacyStorage, _warn_typed_storage_removal

from ..runtime import patches

_QUANTIZED = {torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4}


class _NeuronLegacyStorage(_LegacyStorage):
    """What torch.cuda's legacy storages refuse, refused the same way: device memory has no host buffer, no weak
    host pointer and no shared-memory file."""

    @classmethod
    def from_buffer(cls, *args, **kwargs):
        _warn_typed_storage_removal()
        raise RuntimeError("from_buffer: Not available for neuron storage")

    @classmethod
    def _new_with_weak_ptr(cls, *args, **kwargs):
        raise RuntimeError("_new_with_weak_ptr: Not available for neuron storage")

    @classmethod
    def _new_shared_filename(cls, manager, obj, size, *, device=None, dtype=None):
        raise RuntimeError("_new_shared_filename: Not available for neuron storage")


def _legacy_class(name: str, dtype: torch.dtype) -> type:
    def public_dtype(cls) -> torch.dtype:
        _warn_typed_storage_removal()
        return dtype

    return type(name, (_NeuronLegacyStorage,), {
        "__module__": "torch.neuron", "__qualname__": name,
        "dtype": classproperty(public_dtype), "_dtype": classproperty(lambda cls: dtype)})


LEGACY_STORAGES: dict[str, type] = {
    name: _legacy_class(name, dtype)
    for dtype, name in torch.storage._dtype_to_storage_type_map().items() if dtype not in _QUANTIZED}


def _known_to_torch(done: patches.Applied) -> None:
    done.replace(torch, "_storage_classes", torch._storage_classes | set(LEGACY_STORAGES.values()))


STORAGE_CLASSES = patches.declare(
    "neuron-storage-classes", "torch._storage_classes",
    "torch.is_storage and serialization know torch.neuron.FloatStorage & co, as torch.cuda adds its own",
    "tests/test_device_conformance.py::test_storage_type_is_the_devices_legacy_class", _known_to_torch)
