"""torchneuron.profiler: per-op host times and modelled device times of what runs on `neuron`, as a
Chrome / Perfetto trace and a summary table (profiler.trace); profiler.kineto prices the kernels torch.profiler
records on the device's track."""
from __future__ import annotations

from .trace import Event, profile

__all__ = ["Event", "profile"]
