"""Timing helpers shared by the benchmarks: interleaved A/B runs in one process, medians of repeats."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

# Optimizers are built with foreach=True on both sides. By default PyTorch picks the multi-tensor (foreach)
# implementation only on devices listed as supporting it, which includes every PrivateUse1 backend and not the
# CPU: the default would time a different optimizer algorithm on each side (it made `neuron` look ~20% faster).
FOREACH = True


def sync() -> None:
    """Wait for the device's queued work. A launch on an asynchronous device returns once the kernel is queued, so
    a timer stopped without this measures the launches, not the work, and the device looks faster than it is."""
    torch.accelerator.synchronize()


def interleaved(fns: dict[str, Callable[[], object]], calls: int, repeats: int = 9, warmup: int = 3
                ) -> dict[str, float]:
    """Median seconds per call of each function; the functions alternate (and swap order) every repeat, so a
    noisy neighbour on the shared machine hits all of them alike. Every timed block (and the warmup) ends with a
    device synchronize, for every function alike (on the CPU's it waits for nothing): without it an asynchronous
    device would be timed on the launches of its work only."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn = fns[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            samples[name].append((time.perf_counter() - t0) / calls)
    return {k: statistics.median(v) for k, v in samples.items()}


def row(name: str, neuron: float, cpu: float, unit: str, target: float | None = None) -> dict:
    return {"name": name, "neuron": neuron, "cpu": cpu, "ratio": neuron / cpu, "unit": unit,
            "threads": torch.get_num_threads(), "target": target}
