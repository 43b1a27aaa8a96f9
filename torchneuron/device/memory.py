"""Memory statistics, snapshots and limits of `torch.neuron`, mirroring `torch.cuda.memory`, read from the C++
caching allocator (csrc/allocator.cpp, csrc/memory_history.cpp)."""
from __future__ import annotations

import pickle
import sys
import warnings
from typing import Any, Literal

import torch

from .. import _C
from .module import _checked, _device_t, is_initialized


def memory_stats(device: _device_t = None) -> dict[str, Any]:
    """CUDA-style flat statistics: "allocated_bytes.all.current", "reserved_bytes.large_pool.peak", ... Empty,
    as torch.cuda's, while the device is not initialised (an unusable configuration: nothing can be allocated)."""
    if not is_initialized():
        return {}
    return torch.accelerator.memory_stats(_checked(device))


def memory_allocated(device: _device_t = None) -> int:
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device: _device_t = None) -> int:
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device: _device_t = None) -> int:
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device: _device_t = None) -> int:
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device: _device_t = None) -> None:
    torch._C._accelerator_resetPeakStats(_checked(device))


def reset_accumulated_memory_stats(device: _device_t = None) -> None:
    torch._C._accelerator_resetAccumulatedStats(_checked(device))


def reset_max_memory_allocated(device: _device_t = None) -> None:
    reset_peak_memory_stats(device)


def empty_cache() -> None:
    """Release cached (reserved but unallocated) device memory."""
    torch._C._accelerator_emptyCache()


def mem_get_info(device: _device_t = None) -> tuple[int, int]:
    """(free, total) bytes of the device: total is the modelled core's capacity."""
    return torch._C._accelerator_getMemoryInfo(_checked(device))


def _fmt(n: float) -> str:
    for unit in ("B ", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:7.0f} {unit}" if unit == "B " else f"{n:7.2f} {unit}"
        n /= 1024
    return ""


def memory_summary(device: _device_t = None, abbreviated: bool = False) -> str:
    """A human-readable table of the allocator statistics, like `torch.cuda.memory_summary`."""
    idx = _checked(device)
    stats = memory_stats(idx)
    rows = [("Allocated memory", "allocated_bytes", True), ("Active memory", "active_bytes", True),
            ("Requested memory", "requested_bytes", True), ("Reserved memory", "reserved_bytes", True),
            ("Allocations", "allocation", False), ("Active allocs", "active", False),
            ("Device reserved segments", "segment", False)]
    pools = ("all",) if abbreviated else ("all", "large_pool", "small_pool")
    line = "=" * 83
    out = [line, f" neuron:{idx} memory summary (capacity {_fmt(mem_get_info(idx)[1]).strip()})".ljust(83), line,
           f"{'Metric':<34}|{'Cur Usage':>11} |{'Peak Usage':>11} |{'Tot Alloc':>10} |{'Tot Freed':>10}", line]
    for title, key, is_bytes in rows:
        for pool in pools:
            label = title if pool == "all" else f"  from {pool.replace('_', ' ')}"
            vals = [stats.get(f"{key}.{pool}.{k}", 0) for k in ("current", "peak", "allocated", "freed")]
            cells = [_fmt(v) if is_bytes else f"{v:>11}" for v in vals]
            out.append(f"{label:<34}|{cells[0]:>11} |{cells[1]:>11} |{cells[2]:>10} |{cells[3]:>10}")
        out.append("-" * 83)
    out.append(f"{'Allocation retries':<34}| {stats.get('num_alloc_retries', 0)}")
    out.append(f"{'Out-of-memory errors':<34}| {stats.get('num_ooms', 0)}")
    out.append(line)
    return "\n".join(out) + "\n"


def set_per_process_memory_fraction(fraction: float, device: _device_t = None) -> None:
    """Limit this process to fraction x the device's capacity: an allocation beyond it raises
    torch.OutOfMemoryError (after the cache is released), like torch.cuda.set_per_process_memory_fraction."""
    idx = _checked(device)
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _C._set_memory_fraction(fraction, idx)


def get_per_process_memory_fraction(device: _device_t = None) -> float:
    return _C._get_memory_fraction(_checked(device))


def _record_memory_history(enabled: Literal["state", "all"] | None = "all", context: str | None = "all",
                           stacks: str = "all", max_entries: int = sys.maxsize, device: _device_t = None,
                           clear_history: bool = False, compile_context: bool = False,
                           global_record_annotations: bool = False, skip_actions: list[str] | None = None) -> None:
    """Record the allocator's history (torch.cuda.memory._record_memory_history's arguments) for `_snapshot`.
    Stacks are PyTorch's captured tracebacks: Python frames, plus C++ frames with stacks="all" (slow to
    symbolize). Recording covers every neuron device, as on CUDA."""
    ignored = [n for n, v in (("compile_context", compile_context),
                              ("global_record_annotations", global_record_annotations)) if v]
    if ignored:
        warnings.warn(f"torch.neuron.memory._record_memory_history: {', '.join(ignored)} is not recorded on neuron "
                      "(the snapshot has Python and C++ frames only)", stacklevel=2)
    _C._record_memory_history(enabled, context, stacks, max_entries, clear_history, skip_actions or [])


def _snapshot(device: _device_t = None, augment_with_fx_traces: bool = False) -> dict[str, Any]:
    """The allocator's state in torch.cuda.memory._snapshot()'s format: segments (each with its one block and the
    stack that allocated it) and device_traces (per device, the recorded alloc/free/segment/oom events)."""
    s = _C._memory_snapshot()
    if augment_with_fx_traces:
        from torch._utils import _augment_memory_snapshot_stack_traces

        s = _augment_memory_snapshot_stack_traces(s)
    return s


def _dump_snapshot(filename: str = "dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
    """Pickle `_snapshot()` to `filename`: `python -m torch.cuda._memory_viz trace_plot|segment_plot` and
    pytorch.org/memory_viz read it."""
    s = _snapshot(augment_with_fx_traces=augment_with_fx_traces)
    with open(filename, "wb") as f:
        pickle.dump(s, f)


def memory_snapshot(mempool_id: tuple[int, int] | None = None, include_traces: bool = True) -> list[dict[str, Any]]:
    """The allocator's segments (torch.cuda.memory_snapshot); the neuron allocator has one pool."""
    if mempool_id is not None:
        raise ValueError("neuron has a single memory pool: memory_snapshot takes mempool_id=None")
    return _snapshot()["segments"]
