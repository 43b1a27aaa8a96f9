"""Memory statistics of `torch.neuron`, mirroring `torch.cuda.memory`, read from the C++ caching allocator."""
from __future__ import annotations

from typing import Any

import torch

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
