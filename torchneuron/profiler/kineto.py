"""The modelled device time of the kernels torch.profiler recorded on `neuron` (ProfilerActivity.PrivateUse1).

The C++ core (csrc/profiler.cpp) keeps every kernel the device executes while a trace records and, when the
trace is collected, calls `cost` once with the eager kernels; compiled kernels arrive already costed (`record_kernel`).
Each kernel lands on its engine's row of the device track. The chip is the one the device models
(TORCHNEURON_INSTANCE, NEURON_LOGICAL_NC_CONFIG)."""
from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from .. import _C
from ..costmodel.ops import OpCost, T, op_cost
from .trace import ENGINES, _default_target, kernel_cost


def _spec(shape: tuple[int, ...], dtype: torch.dtype) -> T:
    return T(tuple(shape), str(dtype).removeprefix("torch."))


def _row(c: OpCost) -> tuple[float, int, str]:
    return c.time_s, ENGINES.index(c.engine), c.engine


def cost(batch: list[tuple[str, bool, list, list]]) -> list[tuple[float, int, str]]:
    """(seconds, engine row, engine) per eager kernel (op name, is a view, [(shape, dtype)] in, ... out). A
    kernel the cost model cannot price keeps its event with zero time, and a warning names it."""
    t, out, failed = _default_target(), [], {}
    for name, view, ins, outs in batch:
        try:
            out.append(_row(op_cost("view" if view else name, [_spec(*x) for x in ins], [_spec(*x) for x in outs],
                                    t, mode="eager")))
        except Exception as e:  # noqa: BLE001  (one op's rule must not cost the whole trace its times)
            failed[name] = f"{type(e).__name__}: {e}"
            out.append((0.0, ENGINES.index("none"), "none"))
    if failed:
        warnings.warn(f"torch.profiler on neuron: the cost model could not price {len(failed)} kernel kind(s); "
                      f"their device time is 0: {failed}", stacklevel=2)
    return out


def record_kernel(kernel: Any, args: list) -> list:
    """Run a compiled kernel as a host op (a record_function scope named after it) and record it as one device
    event, neuron::<its name>, costed from its FX graph (cached per kernel: its shapes are static)."""
    ins = [args[i] for i in kernel.device_inputs]
    device = ins[0].device.index if ins else 0
    c = getattr(kernel, "_device_cost", None)
    if c is None:
        c = kernel._device_cost = kernel_cost(kernel.graph, _default_target())
    with torch.profiler.record_function(kernel.name):
        start = time.time_ns()
        out = kernel.run(args)
        _C._record_device_event(f"neuron::{kernel.name}", device, start, time.time_ns(), *_row(c))
    return out
