"""`torchneuron estimate --from-profile`: the op mix of a real run, as torchneuron.profiler recorded it on the
`neuron` device (a profile object or its exported Chrome trace), priced on any Trainium target or GPU.

The profiler records each op's engine, FLOPs (for vector-like engines: elements x passes), HBM bytes and input
dtypes. Here each op is re-priced from those on another target: its engine's rate there (TensorE or the GPU's
matmul rate for the dtype; the vector engines or the GPU's CUDA cores), the target's HBM bandwidth, and a fixed
cost per op (a launch and a kernel eagerly, a kernel in a compiled graph). Tile and wave effects of the new
target are not re-derived (the shapes' FLOPs are kept), and ops are not re-fused: a compiled figure is an upper
bound on what a compiler would reach.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .estimate import Layout
from .ops import T, datapath, dtype_class

_PRICED = ("tensor", "vector", "scalar", "gpsimd", "host", "dma")


@dataclass(frozen=True)
class MixOp:
    """One op of the mix, summed over its calls."""

    name: str
    engine: str
    dtype: str  # of its first input (torch name without the prefix)
    calls: int
    flops: float
    bytes: float


@dataclass(frozen=True)
class MixCost:
    """The mix priced on one core of a target."""

    target: str
    instance: str
    execution: str
    step_s: float
    by_engine: dict[str, float]
    tensor_flops: float
    mfu: float
    cost_per_hour: float | None  # one core, pro rata of the instance
    cost_per_step: float | None


def load(source: Any, steps: int = 1) -> list[MixOp]:
    """The op mix of a torchneuron.profiler.profile (its events) or of the Chrome trace it exported, divided
    by `steps` (the training steps or requests the profile covers)."""
    rows: list[tuple[str, str, str, float, float]] = []
    if hasattr(source, "events"):
        for e in source.events:
            rows.append((e.name, e.cost.engine, e.dtypes[0] if e.dtypes else "float32", e.cost.flops, e.cost.bytes))
    else:
        data = json.loads(Path(source).read_text())
        for ev in data.get("traceEvents", []):
            if ev.get("ph") != "X" or ev.get("pid") == 1 or ev.get("cat") not in (*_PRICED, "free"):
                continue  # process 1 is the host's measured timeline; devices are 2+
            args = ev.get("args", {})
            rows.append((ev["name"], ev["cat"], (args.get("dtypes") or ["float32"])[0], float(args.get("flops", 0)),
                         float(args.get("bytes", 0))))
        if not rows:
            raise ValueError(f"{source}: no device events of torchneuron.profiler (export_chrome_trace) in it")
    agg: dict[tuple[str, str, str], list[float]] = {}
    for name, engine, dtype, flops, nbytes in rows:
        a = agg.setdefault((name, engine, dtype.removeprefix("torch.")), [0, 0.0, 0.0])
        a[0] += 1
        a[1] += flops
        a[2] += nbytes
    return [MixOp(n, e, d, round(c / steps) or 1, f / steps, b / steps) for (n, e, d), (c, f, b) in agg.items()]


def price(mix: list[MixOp], target: str, *, lnc: int | None = None, execution: str = "eager",
          price_per_hour: float | None = None) -> MixCost:
    """The mix on one core of `target` (trn1/trn2/trn3, h100/h200/b200, or an instance name)."""
    lay = Layout.of(target, None, lnc)
    t = lay.target
    by: dict[str, float] = {}
    tensor = 0.0
    flops_in: dict[str, float] = {}  # matmul FLOPs by dtype class: the MFU's peak is that of the one they ran in
    for op in mix:
        if op.engine not in _PRICED:
            continue
        dclass = dtype_class(op.dtype)
        if op.engine == "tensor":
            compute = op.flops / t.matmul_flops(dclass)
            tensor += op.flops
            flops_in[dclass] = flops_in.get(dclass, 0.0) + op.flops
        elif op.engine == "dma":
            compute = 0.0
        else:
            compute = op.flops / t.engine_rate(datapath(op.engine), T((1,), op.dtype).itemsize)
        fixed = t.kernel_s + (t.launch_s if execution == "eager" else 0.0)
        time = max(compute, op.bytes / t.hbm_bw) + op.calls * fixed
        by[op.engine] = by.get(op.engine, 0.0) + time
    step = sum(by.values())
    peak_class = max(flops_in, key=flops_in.get) if flops_in else "bfloat16"
    price = lay.price_per_hour if price_per_hour is None else price_per_hour
    per_hour = None if price is None else price / lay.cores_per_instance
    return MixCost(t.name, lay.instance, execution, step, dict(sorted(by.items(), key=lambda kv: -kv[1])), tensor,
                   tensor / step / t.marketed_flops(peak_class) if step else 0.0, per_hour,
                   None if per_hour is None else per_hour * step / 3600)


def table(costs: list[MixCost]) -> str:
    lines = [f"  {'platform':<30} {'execution':<9} {'time/step':>12} {'MFU':>6} {'$/hour':>9} {'$/M steps':>11}"
             "  busiest engines"]
    for c in costs:
        money = lambda x, d: "n/a" if x is None else f"${x:,.{d}f}"
        engines = ", ".join(f"{e} {s / c.step_s:.0%}" for e, s in list(c.by_engine.items())[:3])
        lines.append(f"  {'1 ' + c.target + ' of ' + c.instance:<30} {c.execution:<9} "
                     f"{c.step_s * 1e3:>9.3f} ms {c.mfu:>6.1%} {money(c.cost_per_hour, 3):>9} "
                     f"{money(None if c.cost_per_step is None else c.cost_per_step * 1e6, 2):>11}  {engines}")
    return "\n".join(lines)
