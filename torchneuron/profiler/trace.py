"""Record the ops and compiled kernels that run on `neuron` tensors: host time (measured) and device time
(modelled by the cost model for the configured chip), exported as a Chrome / Perfetto trace and summarised as
a table.

The modelled device runs work in order on one queue per device: an op starts when the host has issued it and
the previous one has finished, and occupies the engine the cost model assigns it (one trace row per engine).
Eager ops are seen through a TorchDispatchMode. While such a mode is active Dynamo runs compiled functions
eagerly (op by op), so to see torch.compile kernels instead profile with `ops=False`: the compiler then runs
each kernel through this profiler's hook (runtime.tracking.KERNEL_OBSERVERS), which records it as one event costed
from its FX graph. torch.profiler with ProfilerActivity.PrivateUse1 sees both eager and compiled kernels
(profiler.kineto).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..costmodel.ops import OpCost, T, Target, op_cost, target
from ..costmodel.trace import fx_trace
from ..runtime import optable
from ..runtime.optable import base_name
from ..runtime.tracking import KERNEL_OBSERVERS

# Trace rows: the op table's engines, collectives, and "none" (a compiled kernel without a graph, an op the cost
# model could not price).
ENGINES = (*optable.ENGINES, "collective", "none")


@dataclass(frozen=True)
class Event:
    """One op: when the host issued it (ns since the profile began), how long the host took, and where the
    modelled device ran it."""

    name: str  # aten::mm
    device: str  # neuron:0
    host_start_ns: int
    host_ns: int
    device_start_s: float
    cost: OpCost
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def device_s(self) -> float:
        return self.cost.time_s


def kernel_cost(graph: torch.fx.GraphModule | None, t: Target) -> OpCost:
    """A compiled kernel: one launch running its graph as fused kernels (the estimator's compiled rules)."""
    from ..costmodel.estimate import Coster, Layout

    if graph is None:
        return OpCost("compiled_kernel", "none", 0.0, 0.0, 0.0, 0.0, 0.0, t.launch_s, 0.0, t.hbm_bw)
    tr = fx_trace(graph)
    rows = [row for row in Coster(tr, Layout(t, "", 1, None, "", 0.0), 1, False, True).times(tr.recs)
            if row.rec.op != "launch"]  # the launch is the event's overhead
    busy: dict[str, float] = {}
    for row in rows:
        busy[row.cost.engine] = busy.get(row.cost.engine, 0.0) + row.time_s
    nbytes, flops = sum(row.hbm_bytes for row in rows), sum(row.cost.flops for row in rows)
    engine = max(busy, key=busy.get, default="none")
    return OpCost("compiled_kernel", engine, flops, nbytes, nbytes, sum(busy.values()), 0.0, t.launch_s,
                  t.matmul_flops("bfloat16"), t.hbm_bw)


def _default_target() -> Target:
    """The chip the device models (TORCHNEURON_INSTANCE, NEURON_LOGICAL_NC_CONFIG)."""
    from ..hardware import config

    cfg = config.current()
    return target(cfg.instance.chip, cfg.lnc)


class _Mode(TorchDispatchMode):
    def __init__(self, prof: profile):
        super().__init__()
        self.prof = prof

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.perf_counter_ns()
        out = func(*args, **kwargs)
        host = time.perf_counter_ns() - start
        if func.namespace == "aten":
            self.prof._record(func, args, kwargs, out, start, host)
        return out


class profile:
    """Context manager recording every op on `device` tensors ("neuron"; "cpu" or None for any device), or
    with `ops=False` every torch.compile kernel (see the module docstring).

    with torchneuron.profiler.profile() as prof:
        model(x)
    prof.export_chrome_trace("trace.json")   # open in https://ui.perfetto.dev or chrome://tracing
    print(prof.summary())
    """

    def __init__(self, device: str | None = "neuron", target: str | Target | None = None, ops: bool = True):
        self.device_type, self.ops = device, ops
        self._target = target
        self.events: list[Event] = []
        self._queue_end: dict[str, float] = {}

    @property
    def target(self) -> Target:
        if not isinstance(self._target, Target):
            self._target = _default_target() if self._target is None else target(self._target)
        return self._target

    def __enter__(self) -> profile:
        self._t0: int | None = None  # the first op's start: the trace's time zero
        self._unwrap = self._wrap_compiled_kernels()
        from ..nki.kernel import OBSERVERS as nki_observers

        nki_observers.append(self._nki_call)
        self._nki_observers = nki_observers
        self._mode = _Mode(self) if self.ops else None
        if self._mode:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode:
            self._mode.__exit__(*exc)
        self._unwrap()
        self._nki_observers.remove(self._nki_call)

    def _nki_call(self, name: str, kp: Any, ins: list, outs: list, start: int, host: int) -> None:
        """An NKI kernel call on `neuron`: one event, its time the kernel's own modelled timeline (docs/nki.md)."""
        engine = kp.bottleneck if kp.bottleneck in ENGINES else "none"
        self._add(f"nki::{name}", ins, outs, start, host,
                  lambda: OpCost(f"nki::{name}", engine, float(kp.matmul_flops), float(kp.dma_bytes),
                                 float(kp.dma_bytes), kp.latency_s, 0.0, 0.0, 0.0, 0.0))

    def _wrap_compiled_kernels(self):
        def profiled(kernel, args: list) -> list:
            ins = [args[i] for i in kernel.device_inputs]  # the call consumes `args`
            start = time.perf_counter_ns()
            out = kernel.run(args)
            host = time.perf_counter_ns() - start
            self._add("neuron::compiled_kernel", ins, out, start, host, lambda: kernel_cost(kernel.graph, self.target))
            return out

        KERNEL_OBSERVERS.append(profiled)
        return lambda: KERNEL_OBSERVERS.remove(profiled)

    def _record(self, func, args, kwargs, out, start: int, host: int) -> None:
        ins = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        spec = lambda t: T(tuple(t.shape), str(t.dtype).removeprefix("torch."))
        op = base_name(func._overloadpacket.__name__)
        cost = lambda: op_cost("view" if func.is_view else op, [spec(t) for t in ins],
                               [spec(t) for t in outs], self.target, mode="eager")
        self._add(f"aten::{op}", ins, outs, start, host, cost)

    def _add(self, name: str, ins: list, outs: Any, start: int, host: int, cost) -> None:
        """An event for work touching the profiled device (cost: computed only then)."""
        tensors = [*ins, *(o for o in pytree.tree_leaves(outs) if isinstance(o, torch.Tensor))]
        devices = [t.device for t in tensors if self.device_type is None or t.device.type == self.device_type]
        if self.device_type is not None and not devices:
            return
        dev = str(devices[0]) if devices else "cpu"
        self._t0 = start if self._t0 is None else self._t0
        c = cost()
        begin = max((start - self._t0) / 1e9, self._queue_end.get(dev, 0.0))
        self._queue_end[dev] = begin + c.time_s
        self.events.append(Event(name, dev, start - self._t0, host, begin, c,
                                 tuple(tuple(t.shape) for t in ins), tuple(str(t.dtype) for t in ins)))

    # ------------------------------------------------------------------------------------------ outputs

    def chrome_trace(self) -> dict[str, Any]:
        """The Chrome trace-event format (JSON object form) that Perfetto and chrome://tracing open: process 1
        is the host (one row), process 2+ the modelled devices (one row per engine)."""
        devices = sorted({e.device for e in self.events})
        pid = {d: 2 + i for i, d in enumerate(devices)}
        meta = lambda name, p, t, value: {"name": name, "ph": "M", "ts": 0, "dur": 0, "pid": p, "tid": t,
                                          "args": {"name": value}}
        evs = [meta("process_name", 1, 0, "host (measured)"), meta("thread_name", 1, 1, "dispatch")]
        for d in devices:
            evs.append(meta("process_name", pid[d], 0, f"{d} (modelled {self.target.name})"))
            evs += [meta("thread_name", pid[d], 1 + i, f"{e} engine") for i, e in enumerate(ENGINES)]
        for e in self.events:
            shapes = ["x".join(map(str, s)) for s in e.shapes]
            evs.append({"name": e.name, "ph": "X", "ts": e.host_start_ns / 1e3, "dur": e.host_ns / 1e3,
                        "pid": 1, "tid": 1, "cat": "host", "args": {"device": e.device, "shapes": shapes}})
            if not e.device_s:
                continue
            c = e.cost
            evs.append({"name": e.name, "ph": "X", "ts": e.device_start_s * 1e6, "dur": c.time_s * 1e6,
                        "pid": pid[e.device], "tid": 1 + ENGINES.index(c.engine), "cat": c.engine,
                        "args": {"shapes": shapes, "dtypes": list(e.dtypes), "flops": c.flops,
                                 "bytes": c.bytes, "bound": c.bound, "achieved": round(c.achieved, 4),
                                 "host_us": e.host_ns / 1e3}})
        return {"traceEvents": evs, "displayTimeUnit": "ms",
                "otherData": {"producer": "torchneuron.profiler", "target": self.target.name,
                              "note": "device times are modelled by torchneuron.costmodel, not measured"}}

    def export_chrome_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.chrome_trace()))
        return path

    def totals(self) -> dict[str, float]:
        """Seconds: host time, modelled device time (busy), and the device's busy time per engine."""
        out = {"host_s": sum(e.host_ns for e in self.events) / 1e9,
               "device_s": sum(e.device_s for e in self.events)}
        for e in self.events:
            out[f"{e.cost.engine}_s"] = out.get(f"{e.cost.engine}_s", 0.0) + e.device_s
        return out

    def table(self) -> list[dict[str, Any]]:
        """Per op name: calls, host and modelled device time, engine, bound, achieved fraction (weighted by
        time)."""
        rows: dict[str, dict[str, Any]] = {}
        for e in self.events:
            r = rows.setdefault(e.name, {"op": e.name, "engine": e.cost.engine, "calls": 0, "host_s": 0.0,
                                         "device_s": 0.0, "flops": 0.0, "bounds": {}, "weighted": 0.0})
            r["calls"] += 1
            r["host_s"] += e.host_ns / 1e9
            r["device_s"] += e.device_s
            r["flops"] += e.cost.flops
            r["bounds"][e.cost.bound] = r["bounds"].get(e.cost.bound, 0.0) + e.device_s
            r["weighted"] += e.cost.achieved * e.device_s
        for r in rows.values():
            r["bound"] = max(r.pop("bounds").items(), key=lambda kv: kv[1])[0]
            r["achieved"] = r.pop("weighted") / r["device_s"] if r["device_s"] else 0.0
        return sorted(rows.values(), key=lambda r: -r["device_s"])

    def summary(self, top: int = 15) -> str:
        """The top ops by modelled device time, with their engine, bound and fraction of peak."""
        rows, tot = self.table(), self.totals()
        head = (f"{'op':<40} {'calls':>6} {'host ms':>9} {'device ms':>10} {'dev %':>6} {'engine':<8} "
                f"{'bound':<9} {'achieved':>8}")
        lines = [f"torchneuron profile: {len(self.events)} ops, host {tot['host_s'] * 1e3:.3f} ms, modelled "
                 f"{self.target.name} device {tot['device_s'] * 1e3:.3f} ms", head, "-" * len(head)]
        for r in rows[:top]:
            share = r["device_s"] / tot["device_s"] if tot["device_s"] else 0.0
            lines.append(f"{r['op'][:40]:<40} {r['calls']:>6} {r['host_s'] * 1e3:>9.3f} "
                         f"{r['device_s'] * 1e3:>10.4f} {share:>6.1%} {r['engine']:<8} {r['bound']:<9} "
                         f"{r['achieved']:>8.1%}")
        return "\n".join(lines)
