"""nn.DataParallel on neuron: torch.nn.parallel.comm's scatter, gather, broadcast_coalesced and reduce_add_coalesced
call CUDA-only C++ (`torch._C._scatter` & co, absent from builds without CUDA), so `nn.DataParallel(model)` failed
with an AttributeError at its first forward, even on one core (it scatters before checking the device count).
Here they are the same data movement written with `Tensor.to`, for neuron tensors and integer device ids (which
name the accelerator); every other call reaches PyTorch's function."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._utils import _get_device_index
from torch.nn.parallel import comm

from ..runtime import patches


def _ours(*tensors: Any) -> bool:
    """Is this call the device's? A neuron tensor takes part, or this build has no CUDA comm to run it."""
    return not hasattr(torch._C, "_scatter") or any(
        isinstance(t, torch.Tensor) and t.device.type == "neuron" for t in tensors)


def _neuron(index: int) -> torch.device:
    return torch.device("cpu") if index == -1 else torch.device("neuron", index)


def _scatter(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def scatter(tensor: torch.Tensor, devices: Sequence[Any] | None = None, chunk_sizes: Sequence[int] | None = None,
                dim: int = 0, streams: Any = None, *, out: Sequence[torch.Tensor] | None = None) -> tuple:
        if not _ours(tensor, *(out or ())):
            return orig(tensor, devices, chunk_sizes, dim, streams, out=out)
        if out is not None:  # CUDA's rules: out sizes give the chunks
            for o, c in zip(out, tensor.split([o.size(dim) for o in out], dim), strict=True):
                o.copy_(c)
            return tuple(out)
        targets = [_neuron(_get_device_index(d)) for d in devices]
        chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes else tensor.chunk(len(targets), dim)
        # as CUDA's: a batch smaller than the device count (chunk gives fewer pieces) fills the first devices only
        return tuple(c.to(d) for c, d in zip(chunks, targets, strict=False))
    return scatter


def _gather(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def gather(tensors: Sequence[torch.Tensor], dim: int = 0, destination: Any = None, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        if not _ours(*tensors, out):
            return orig(tensors, dim, destination, out=out)
        if out is not None:
            return torch.cat([t.to(out.device) for t in tensors], dim, out=out)
        dest = _neuron(_get_device_index(destination, allow_cpu=True, optional=True))
        return torch.cat([t.to(dest) for t in tensors], dim)
    return gather


def _broadcast_coalesced(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[Any],
                            buffer_size: int = 10485760) -> list:
        if not _ours(*tensors):
            return orig(tensors, devices, buffer_size)
        # as CUDA's: the source device gets the tensors themselves, the others copies
        return [[t.to(_neuron(_get_device_index(d))) for t in tensors] for d in devices]
    return broadcast_coalesced


def _reduce_add_coalesced(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def reduce_add_coalesced(inputs: Sequence[Sequence[torch.Tensor]], destination: Any = None,
                             buffer_size: int = 10485760) -> tuple:
        if not _ours(*(t for ts in inputs for t in ts)):
            return orig(inputs, destination, buffer_size)
        dest = _neuron(_get_device_index(destination, optional=True))
        sums = []
        for at_devices in zip(*inputs, strict=True):
            total = at_devices[0].to(dest, copy=True)  # a new tensor, never an alias of a replica's gradient
            for t in at_devices[1:]:
                total.add_(t.to(dest))
            sums.append(total)
        return tuple(sums)
    return reduce_add_coalesced


def _data_parallel_comm(done: patches.Applied) -> None:
    for name, make in (("scatter", _scatter), ("gather", _gather), ("broadcast_coalesced", _broadcast_coalesced),
                       ("reduce_add_coalesced", _reduce_add_coalesced)):
        done.replace(comm, name, make(getattr(comm, name)))


DATA_PARALLEL_COMM = patches.declare(
    "data-parallel-comm", "torch.nn.parallel.comm.scatter, gather, broadcast_coalesced, reduce_add_coalesced",
    "nn.DataParallel scatters, replicates and gathers neuron tensors (PyTorch's are CUDA-only C++)",
    "tests/test_multidevice.py::test_data_parallel_matches_the_cpu", _data_parallel_comm)
