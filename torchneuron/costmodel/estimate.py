"""torchneuron.estimate: how long one training step, forward pass or decode step of a model would take on a
Trainium instance, how well it would use the chip, and what it would cost, compared with a GPU job laid out as a
buyer would (compare_gpu).

The model runs on meta tensors (costmodel.trace), so nothing is computed and a 70B model needs no memory.
Every recorded op is costed on one logical core with costmodel.ops; a compiled step groups ops into fused
kernels (see Coster.groups; intermediates that fit in SBUF stay there). Tensor parallelism divides each op
as the trace's layout says and adds its collectives; data parallelism adds the gradient all-reduce. All the
assumptions are listed in docs/costmodel.md.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from ..hardware.chips import CHIPS, GPU_INSTANCES, INSTANCES, LARGEST_INSTANCE, Chip
from ..runtime.optable import Rule, op_info
from .ops import OpCost, Target, collective_cost, input_share, kernel_time, nxd_moe, op_cost, target
from .trace import Rec, Trace, trace


class EstimateError(ValueError):
    """Arguments no estimate can take (a layout the model or machine cannot have, a value out of range): the CLI
    reports it as a usage error; any other exception is a bug and keeps its traceback."""

MODES = ("train", "forward", "decode")
RECOMPUTE = ("none", "selective", "full")
EXECUTIONS = ("compiled", "eager")
SCHEDULES = ("1f1b", "gpipe", "interleaved")  # pipeline schedules
# Rank order: tensor-parallel ranks innermost, then expert- and data-parallel replicas, pipeline stages outermost,
# as Megatron-LM (`initialize_model_parallel(order="tp-cp-ep-dp-pp")`) and NxD (`parallel_state`: a pipeline
# group's ranks are world / pp apart) number them: TP and then DP groups fill an instance first.
# Matmul precision beyond the traced dtype: "fp8" runs every 16-bit matmul in fp8 (weights, activations and, in
# training, gradients, as Transformer Engine / NxD fp8 recipes do) at the fp8 peak; "w8" stores weights in 8 bits
# (int8 / fp8 weight-only quantization) and computes in 16 bits. None: as traced.
PRECISIONS = (None, "fp8", "w8")
# Bytes an update reads and writes per parameter (fp32 param or master weight and moments), and the fp32
# optimizer state it keeps.
OPTIMIZER_BYTES = {"adamw": 3 * 8, "adam": 3 * 8, "sgd": 2 * 8, None: 0}
OPTIMIZER_STATE = {"adamw": 8, "adam": 8, "sgd": 4, None: 0}


@dataclass(frozen=True)
class OpTime:
    """One op's share of a step on one core. `count`: how many times a step runs it (micro-steps)."""

    op: str
    phase: str  # forward | backward | recompute | grad_sync | optimizer
    engine: str
    flops: float
    bytes: float
    time_s: float
    bound: str
    achieved: float
    count: float = 1.0
    shapes: str = ""


class TopOp(NamedTuple):
    """One row of EstimateResult.top: an op (on one engine) and its share of a step."""

    op: str
    engine: str
    time_s: float  # per step, all calls
    bound: str  # what bounds most of its time
    achieved: float  # time-weighted mean fraction of the engine's peak
    calls: int  # per step


class OpShare(NamedTuple):
    """One recorded op as Coster.times costs it: its own cost, and its share of the modelled time and of the HBM
    traffic of the kernel it runs in (fused kernels split theirs in proportion to each op's cost)."""

    rec: Rec
    cost: OpCost
    time_s: float
    hbm_bytes: float


@dataclass(frozen=True)
class Layout:
    """Where a job runs: a target core type on an instance type, with its price."""

    target: Target
    instance: str
    cores_per_instance: int
    price_per_hour: float | None
    price_source: str
    efa_bw: float  # bytes/s per instance

    @classmethod
    def of(cls, tgt: str | Target, instance: str | None = None, lnc: int | None = None) -> Layout:
        if isinstance(tgt, str) and (tgt in INSTANCES or tgt in GPU_INSTANCES):
            instance, tgt = tgt, tgt
        t = target(tgt, lnc)
        if not t.is_neuron:
            name = instance or next(n for n, g in GPU_INSTANCES.items() if g.gpu == t.name)
            gi = GPU_INSTANCES[name]
            return cls(t, name, gi.gpus, gi.price_per_hour, gi.price_source, gi.efa_bps / 8)
        name = instance or LARGEST_INSTANCE[t.name]
        inst = INSTANCES[name]
        if inst.chip != t.name:
            raise EstimateError(f"{name} has {inst.chip} chips, not {t.name}")
        assert isinstance(t.spec, Chip)
        return cls(t, name, inst.chips * t.spec.logical_cores(t.lnc), inst.price_per_hour, inst.price_source,
                   inst.efa_bps / 8)

    def check_tp(self, tp: int) -> None:
        """TP groups are packed inside one instance: the degree is at most its logical cores."""
        if not 1 <= tp <= self.cores_per_instance:
            raise EstimateError(f"the tensor-parallel degree must be in 1..{self.cores_per_instance} (the "
                             f"{self.target.name} cores of one {self.instance}), got {tp}")

    def collective(self, kind: str, nbytes: float, ranks: int, stride: int = 1) -> OpCost:
        """A collective over `ranks` cores spaced `stride` apart (TP groups are packed, DP groups strided)."""
        per_node = max(1, min(ranks, self.cores_per_instance // stride))
        busy = min(self.cores_per_instance, ranks * stride)  # cores of one instance sharing its EFA at once
        return collective_cost(kind, nbytes, ranks, self.target, ranks_per_node=per_node,
                               efa_bw=self.efa_bw / busy)


@dataclass
class EstimateResult:
    """A modelled step. Times are seconds; costs USD (the instance price pro rata for the cores used)."""

    target: str
    instance: str
    mode: str
    execution: str
    dp: int
    tp: int
    lnc: int
    cores: int
    instances: int
    micro_steps: float
    step_time_s: float
    items_per_step: float
    unit: str  # tokens | samples
    items_per_s: float
    mfu: float
    price_per_hour: float | None  # of one instance
    price_source: str
    cost_per_hour: float | None
    cost_per_step: float | None
    cost_per_million: float | None  # per million items
    memory: dict[str, float]  # bytes per core by kind, and "capacity"
    ops: list[OpTime] = field(repr=False, default_factory=list)
    comparison: EstimateResult | None = field(repr=False, default=None)
    precision: str | None = None
    note: str = ""  # how the layout was chosen (the GPU comparison)
    cores_per_instance: int = 0
    pp: int = 1
    ep: int = 1

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.memory["capacity"]

    def by(self, key: str = "phase") -> dict[str, float]:
        """Step time split by op attribute (phase, engine, op, bound), largest first."""
        out: dict[str, float] = {}
        for o in self.ops:
            out[getattr(o, key)] = out.get(getattr(o, key), 0.0) + o.time_s * o.count
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def top(self, n: int = 10) -> list[TopOp]:
        """The n ops with most time per step."""
        agg: dict[tuple[str, str], list[float]] = {}
        for o in self.ops:
            a = agg.setdefault((o.op, o.engine), [0.0, 0.0, 0.0, {}])
            a[0] += o.time_s * o.count
            a[1] += o.achieved * o.time_s * o.count
            a[2] += o.count
            a[3][o.bound] = a[3].get(o.bound, 0.0) + o.time_s
        rows = [TopOp(op, eng, t, max(b, key=b.get), w / t if t else 0.0, int(round(c)))
                for (op, eng), (t, w, c, b) in agg.items()]
        return sorted(rows, key=lambda r: -r.time_s)[:n]

    def summary(self) -> str:
        per = {"train": "training step", "forward": "forward pass", "decode": "decode step"}[self.mode]
        kind = "core" if self.target in CHIPS else "GPU"
        lines = [f"{per} on {self.cores} x {self.target} {kind}{'s' if self.cores > 1 else ''} "
                 f"({self.instance}, dp={self.dp} tp={self.tp}{f' pp={self.pp}' if self.pp > 1 else ''}"
                 f"{f' ep={self.ep}' if self.ep > 1 else ''}"
                 f"{', ' + self.precision if self.precision else ''}, "
                 f"{self.execution}): "
                 f"{_ms(self.step_time_s)}, {self.items_per_s:,.0f} {self.unit}/s, MFU {self.mfu:.1%}"]
        if self.cost_per_hour is not None:
            lines.append(f"  cost ${self.cost_per_hour:,.2f}/h (pro rata of ${self.price_per_hour:,.2f}/h "
                         f"per instance, estimate), ${self.cost_per_million:,.4f} per million {self.unit}")
        total, cap = self.memory["total"] / 2**30, self.memory["capacity"] / 2**30
        fits = "" if self.fits else "  DOES NOT FIT (see estimate.fit_error)"
        lines.append(f"  memory per core {total:,.2f} GiB of {cap:,.0f} GiB{fits}")
        split = ", ".join(f"{k} {v / self.step_time_s:.0%}" for k, v in self.by("phase").items() if v)
        lines.append(f"  time: {split}")
        if self.note:
            lines.append(f"  {self.note}")
        return "\n".join(lines)


def _ms(s: float) -> str:
    return f"{s * 1e3:,.3f} ms" if s < 1 else f"{s:,.3f} s"


def _shapes(r: Rec) -> str:
    return " ".join("x".join(map(str, t.shape)) or "scalar" for t in r.ins[:3])


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts part of a trace: the expert weights ([E, K, N] operands of `_grouped_mm`, views
    included), their parameters, the experts per layer, and per MoE layer the bytes of the routed rows
    [tokens x experts per token, hidden] that expert parallelism dispatches to the experts' cores and
    combines back (the forward's; the backward moves their gradients)."""

    weights: frozenset[int]
    params: int
    per_layer: int
    dispatch: tuple[float, ...]
    tokens: dict[int, int] = field(default_factory=dict)  # routing (offsets id) -> tokens routed, where traced


def experts(tr: Trace) -> Experts:
    """The expert GEMMs of one MoE layer share its routing (the offsets of the rows grouped by expert): the first
    of them reads the dispatched rows."""
    grouped = [r for r in tr.recs if r.phase == "forward" and r.op == "_grouped_mm" and len(r.ins) > 2
               and len(r.ins[1].shape) == 3]
    weights = {i for r in tr.recs if r.op == "_grouped_mm"  # the backward's views of the weights too
               for x, i in zip(r.ins, r.in_ids, strict=False) if len(x.shape) == 3 and tr.placement.get(i) == "W"}
    first = {r.in_ids[2]: r for r in reversed(grouped)}  # the first GEMM of each routing
    made = {o: r for r in tr.recs for o in r.out_ids}
    tokens = {}  # the tokens a routing dispatches: the [tokens, hidden] input of the gather making its rows
    for i, r in first.items():
        src = made.get(r.in_ids[0])
        if src and op_info(src.op).rule is Rule.GATHER and len(src.ins[0].shape) == 2 \
                and r.ins[0].shape[0] % src.ins[0].shape[0] == 0:
            tokens[i] = src.ins[0].shape[0]
    return Experts(frozenset(weights), sum(r.ins[1].numel for r in grouped),
                   grouped[0].ins[1].shape[0] if grouped else 0, tuple(r.ins[0].nbytes for r in first.values()),
                   tokens)


class Coster:
    """Costs a trace on one layout: per-core shapes under tensor parallelism, fused kernels or eager ops."""

    def __init__(self, tr: Trace, lay: Layout, tp: int, sp: bool, compiled: bool, precision: str | None = None,
                 ep: int = 1, serving: str | None = None):
        self.tr, self.lay, self.t, self.tp, self.sp, self.compiled = tr, lay, lay.target, tp, sp, compiled
        self.precision, self.ep, self.serving = precision, ep, serving  # serving: None, "prefill" or "decode"
        self.experts = experts(tr)

    def costed(self, r: Rec) -> tuple[list, list, dict, float]:
        """A rec's inputs, outputs and attributes as costed (quantized, expert-sharded), and the share of its FLOPs
        that are the model's. Serving on Trainium, an expert GEMM does the work NxD's MoE layer does (nxd_moe:
        padded blocks, or every token through every expert), of which only the routed rows are model FLOPs."""
        ins, outs, attrs = self._expert_shard(r, self._quantized(r)), r.outs, r.attrs
        tokens = self.experts.tokens.get(r.in_ids[2]) if r.op == "_grouped_mm" and len(r.in_ids) > 2 else None
        if not (self.serving and self.t.is_neuron and tokens and len(ins[0].shape) == 2 and len(ins[1].shape) == 3):
            return ins, outs, attrs, 1.0
        m = ins[0].shape[0]
        rows, loaded = nxd_moe(m, ins[1].shape[0], tokens, self.serving == "decode")
        ins = [ins[0]._replace(shape=(rows, ins[0].shape[1])), *ins[1:]]
        outs = [outs[0]._replace(shape=(rows, outs[0].shape[1])), *outs[1:]]
        return ins, outs, {**attrs, "experts_loaded": loaded}, m / rows

    def _expert_shard(self, r: Rec, ins: list) -> list:
        """Under expert parallelism a core holds 1/ep of every expert weight [E, K, N] (whole experts)."""
        if self.ep == 1 or r.op != "_grouped_mm":
            return ins
        return [x._replace(shape=(x.shape[0] // self.ep, *x.shape[1:]))
                if len(x.shape) == 3 and self.tr.placement.get(i) == "W" else x
                for x, i in zip(ins, r.in_ids, strict=False)] + list(ins[len(r.in_ids):])

    def _quantized(self, r: Rec) -> list:
        """A matmul's inputs under the plan's precision: 8-bit weights (placement W), and under fp8 8-bit
        activations and gradients too."""
        if not self.precision or op_info(r.op).rule is not Rule.MATMUL:
            return r.ins
        low = "float8_e4m3fn" if self.precision == "fp8" else "int8"
        out = []
        for x, i in zip(r.ins, r.in_ids, strict=False):
            weight = self.tr.placement.get(i) == "W"
            if x.dtype in ("bfloat16", "float16", "float32") and (weight or self.precision == "fp8"):
                x = x._replace(dtype=low)
            out.append(x)
        return out + list(r.ins[len(out):])

    def per_core_bytes(self, i: int) -> float:
        """A tensor's bytes on one core: sharded data and weights are split; replicated data (and partial
        sums, costed as if reduce-scattered) are split only under sequence parallelism."""
        p = self.tr.placement.get(i, "R")
        split = p in ("S", "W") or (p in ("R", "P") and self.sp)
        spec = self.tr.specs[i]
        nbytes = spec.numel if self.precision and p == "W" and spec.dtype.startswith(("float", "bfloat")) \
            else spec.nbytes  # 8-bit weights
        return nbytes / (self.tp if split else 1) / (self.ep if i in self.experts.weights else 1)

    def op(self, r: Rec, mode: str) -> OpCost:
        if r.op == "all_reduce":
            n = r.ins[0].nbytes
            parts = ("reduce_scatter", "all_gather") if self.sp else ("all_reduce",)
            cs = [self.lay.collective(k, n, self.tp) for k in parts]
            return replace(cs[0], op="+".join(parts), compute_s=sum(c.compute_s for c in cs),
                           bytes=sum(c.bytes for c in cs), io_bytes=sum(c.io_bytes for c in cs))
        shard = None
        if self.tp > 1 and r.shard and (r.shard != "sp" or self.sp):
            shard = ("all" if r.shard == "sp" else r.shard, self.tp)
        ins, outs, attrs, model = self.costed(r)
        c = op_cost(r.op, ins, outs, self.t, attrs=attrs, shard=shard, mode=mode)
        return c if model == 1.0 else replace(c, flops=c.flops * model)

    def times(self, recs: list[Rec]) -> list[OpShare]:
        """Each op's cost and modelled time and traffic; collectives dropped when tp == 1. In a fused kernel each
        op gets the kernel's time and traffic in proportion to its own cost."""
        recs = [r for r in recs if self.tp > 1 or r.op != "all_reduce"]
        if not self.compiled:
            out = []
            for r in recs:
                c = self.op(r, "eager")
                out.append(OpShare(r, c, c.time_s + (self.t.launch_s if c.engine == "collective" else 0.0), c.bytes))
            return out
        costs = [self.op(r, "fused") for r in recs]
        groups = self.groups(recs, costs)
        launch = OpCost("launch", "none", 0.0, 0.0, 0.0, 0.0, 0.0, self.t.launch_s, 0.0, self.t.hbm_bw)
        out: list[OpShare] = [  # one launch per compiled graph (forward, backward)
            OpShare(Rec("launch", phase, [], [], [], []), launch, launch.time_s, 0.0)
            for phase in dict.fromkeys(r.phase for r in recs)]
        owner = {i: g for g, idx in enumerate(groups) for i in idx}
        consumers: dict[int, set[int]] = {}
        for i, r in enumerate(recs):
            for t in r.in_ids:
                consumers.setdefault(t, set()).add(owner[i])
        for g, idx in enumerate(groups):
            if costs[idx[0]].engine == "collective":
                c = costs[idx[0]]
                out.append(OpShare(recs[idx[0]], c, c.time_s, c.bytes))
                continue
            made = {t for i in idx for t in recs[i].out_ids}
            ext = {t for i in idx for t in recs[i].in_ids} - made
            written = {t for t in made if consumers.get(t, {g}) != {g} or t not in consumers}
            spilled = {t for t in made - written if self.per_core_bytes(t) > self.t.sbuf_bytes / 2}
            read: dict[int, float] = {}  # the share of each input the kernel reads (a grouped GEMM: its experts hit)
            for i in idx:
                ins, _, attrs, _ = self.costed(recs[i])
                for pos, t in enumerate(recs[i].in_ids):
                    read[t] = max(read.get(t, 0.0), input_share(recs[i].op, ins, pos, attrs))
            hbm = sum(self.per_core_bytes(t) * read.get(t, 1.0) for t in ext | written) \
                + 2 * sum(map(self.per_core_bytes, spilled))
            hbm += sum(costs[i].bytes - costs[i].io_bytes for i in idx)
            kt = kernel_time([costs[i] for i in idx], hbm, self.t)
            weight = [max(costs[i].compute_s, costs[i].memory_s) for i in idx]
            total = sum(weight)
            for i, w in zip(idx, weight, strict=True):
                share = w / total if total else 1 / len(idx)
                out.append(OpShare(recs[i], costs[i], kt * share, hbm * share))
        return out

    @staticmethod
    def groups(recs: list[Rec], costs: list[OpCost]) -> list[list[int]]:
        """Greedy fusion in program order: a vector/scalar/DMA (or host fallback) op joins the open kernel when it
        consumes a value made in it (same phase); anything else opens a new kernel; collectives stand alone."""
        groups: list[list[int]] = []
        made: set[int] = set()
        for i, (r, c) in enumerate(zip(recs, costs, strict=True)):
            joins = (groups and c.engine in ("vector", "scalar", "dma", "host") and not made.isdisjoint(r.in_ids)
                     and costs[groups[-1][0]].engine != "collective" and recs[groups[-1][0]].phase == r.phase)
            if joins:
                groups[-1].append(i)
                made.update(r.out_ids)
            else:
                groups.append([i])
                made = set(r.out_ids)
        return groups


@dataclass(frozen=True)
class Plan:
    """How the step runs: see estimate() for the meaning of each field."""

    mode: str = "train"
    dp: int = 1
    tp: int = 1
    batch_items: float | None = None
    sequence_parallel: bool | None = None
    execution: str = "compiled"
    recompute: str = "none"
    optimizer: str | None = "adamw"
    zero1: bool = True
    precision: str | None = None
    fsdp: bool = False  # ZeRO-3: weights, gradients and optimizer state sharded over dp
    pp: int = 1  # pipeline stages (layers split evenly)
    schedule: str = "1f1b"
    vpp: int = 1  # virtual stages per core under the interleaved schedule
    ep: int = 1  # expert-parallel degree: MoE experts split over ep of the dp replicas (all-to-all dispatch)

    def __post_init__(self):
        """Each bad value raises a ValueError naming the argument, its value and what it may be."""
        choices = {"mode": MODES, "recompute": RECOMPUTE, "execution": EXECUTIONS, "schedule": SCHEDULES,
                   "precision": PRECISIONS, "optimizer": tuple(OPTIMIZER_BYTES)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise EstimateError(f"{name}={getattr(self, name)!r}: expected one of {allowed}")
        for name in ("dp", "tp", "pp", "vpp", "ep"):
            value = getattr(self, name)
            try:  # any integer type (a numpy int too), never a bool
                ok = not isinstance(value, bool) and operator.index(value) >= 1
            except TypeError:
                ok = False
            if not ok:
                raise EstimateError(f"{name}={value!r}: expected an integer >= 1")
            object.__setattr__(self, name, operator.index(value))
        if self.batch_items is not None and not (math.isfinite(self.batch_items) and self.batch_items > 0):
            raise EstimateError(f"batch_tokens={self.batch_items!r}: expected a number > 0 (or None: one micro-batch "
                             "per data-parallel rank)")
        if self.vpp > 1 and self.schedule != "interleaved":
            raise EstimateError(f"vpp={self.vpp} needs schedule='interleaved', got {self.schedule!r}")
        if self.precision == "w8" and self.train:
            raise EstimateError("precision='w8' (weight-only 8-bit) is for inference: use 'fp8' to train in fp8")
        if self.dp % self.ep:
            raise EstimateError(f"the expert-parallel degree ({self.ep}) must divide the data-parallel degree "
                             f"({self.dp}): experts are split over data-parallel replicas")

    @property
    def train(self) -> bool:
        return self.mode == "train"

    @property
    def bubble(self) -> float:
        """Idle micro-step slots of a pipelined step: p - 1 (GPipe, 1F1B), (p - 1) / v interleaved."""
        return (self.pp - 1) / (self.vpp if self.schedule == "interleaved" else 1)

    @property
    def sp(self) -> bool:
        return self.tp > 1 and (self.train if self.sequence_parallel is None else self.sequence_parallel)


def _optimizer_ops(tr: Trace, lay: Layout, plan: Plan, itemsize: float, micro: float) -> list[OpTime]:
    """Once per step: the gradient all-reduce over the data-parallel group (reduce-scatter + all-gather under
    ZeRO-1 moves the same bytes; under FSDP two weight all-gathers and a gradient reduce-scatter every
    micro-step, not overlapped), then the optimizer update, bound by HBM bandwidth."""
    ops = []
    expert = experts(tr).params
    split = plan.tp * plan.pp  # a core holds 1/tp of 1/pp of the layers
    # (parameters per core, data-parallel group, its stride) (rank order above): the dp replicas of a stage are tp
    # ranks apart; under expert parallelism (ep replicas next to each other) a core holds 1/ep of the experts,
    # synchronised over the dp / ep replicas holding the same ones
    groups = [((tr.param_count - expert) / split, plan.dp, plan.tp),
              (expert / plan.ep / split, plan.dp // plan.ep, plan.tp * plan.ep)]
    for per_core, ranks, step in groups:
        if ranks == 1 or not per_core:
            continue
        if plan.fsdp:  # every micro-step: gather the weights for the forward and the backward,
            for kind in ("all_gather", "all_gather", "reduce_scatter"):  # reduce-scatter the gradients
                c = lay.collective(kind, per_core * itemsize, ranks, stride=step)
                ops.append(OpTime(kind, "grad_sync", "collective", 0.0, c.bytes, c.time_s, c.bound, c.achieved,
                                  micro))
        else:
            c = lay.collective("all_reduce", per_core * itemsize, ranks, stride=step)
            ops.append(OpTime("all_reduce", "grad_sync", "collective", 0.0, c.bytes, c.time_s, c.bound,
                              c.achieved))
    if plan.optimizer:
        own = sum(n / (r if plan.zero1 or plan.fsdp else 1) for n, r, _ in groups)
        nbytes = own * (OPTIMIZER_BYTES[plan.optimizer] + itemsize * (2 if itemsize < 4 else 1))
        bw = lay.target.hbm_bw
        t = nbytes / bw + lay.target.kernel_s
        ops.append(OpTime(plan.optimizer, "optimizer", "vector", 0.0, nbytes, t, "memory", nbytes / t / bw))
    return ops


def _memory(tr: Trace, co: Coster, plan: Plan, itemsize: float, micro: float = 1.0) -> dict[str, float]:
    """Bytes per core: weights (8-bit when served quantized), inputs (a KV cache), and for training gradients,
    optimizer state (fp32 moments, plus fp32 master weights under mixed precision; split over dp under ZeRO-1,
    and weights and gradients too under FSDP) and the activations kept for the backward: every forward tensor
    the backward reads; under selective recomputation less the attention's; under full recomputation one
    layer's worth plus each layer's input (layers = attention ops)."""
    tp = plan.tp * plan.pp  # a core holds 1/pp of the layers
    # the share of the parameters a core holds: experts split over ep (under FSDP / ZeRO-1 every parameter is
    # split over all dp replicas anyway: the experts over ep, then over the dp / ep holding the same ones)
    held = 1 - co.experts.params / tr.param_count * (1 - 1 / plan.ep) if tr.param_count else 1.0
    shard = 1 / plan.dp if plan.fsdp else held
    stored = tr.param_count if plan.precision and not plan.train else tr.param_bytes  # 8-bit weights served
    mem = {"weights": stored / tp * shard, "inputs": tr.input_bytes / tp}
    if plan.train:
        mem["gradients"] = tr.param_bytes / tp * shard
        state = OPTIMIZER_STATE[plan.optimizer] + (4 if itemsize < 4 else 0)
        mem["optimizer"] = tr.param_count / tp * state * (1 / plan.dp if plan.zero1 or plan.fsdp else held)
        fwd = {t: r for r in tr.recs if r.phase == "forward" for t in r.out_ids}
        saved = {t for r in tr.recs if r.phase == "backward" for t in r.in_ids} & set(fwd)
        attention = [r for r in tr.recs if r.phase == "forward" and op_info(r.op).rule is Rule.ATTENTION]
        if plan.recompute == "selective":
            saved -= {t for r in attention for t in r.out_ids}
        total = sum(map(co.per_core_bytes, saved))
        if plan.recompute == "full" and attention:
            hidden = attention[0].ins[0].nbytes / (plan.tp if co.sp else 1)  # a layer's input: tokens x hidden
            total = total / len(attention) + len(attention) * hidden
        # pipelined: a stage keeps micro-batches in flight over its 1/pp of the layers: min(m, p) under 1F1B (the
        # first stage), x (1 + (p - 1) / (p v)) interleaved, all m under GPipe
        inflight = micro if plan.schedule == "gpipe" else min(micro, plan.pp)
        if plan.schedule == "interleaved" and plan.pp > 1:
            inflight *= 1 + (plan.pp - 1) / (plan.pp * plan.vpp)
        mem["activations"] = total * inflight / plan.pp
    mem["total"] = sum(mem.values())
    mem["capacity"] = float(co.t.hbm_bytes)
    return mem


def fit_error(tr: Trace, layout: Layout, plan: Plan) -> str | None:
    """None when the step fits in a core's memory; else what does not fit and the smallest change that would:
    expert parallelism over the data-parallel replicas (MoE), recomputation, FSDP, 8-bit weights (inference), in
    that order; else the smallest tensor-parallel degree
    inside an instance and the smallest pipeline depth that fit."""
    itemsize = tr.param_bytes / tr.param_count if tr.param_count else 4
    mem = lambda p: _memory(tr, Coster(tr, layout, p.tp, p.sp, True, p.precision, p.ep), p, itemsize,
                            _micro(tr, p))
    m = mem(plan)
    if m["total"] <= m["capacity"]:
        return None
    gib = lambda x: f"{x / 2**30:,.1f} GiB"
    parts = ", ".join(f"{k} {gib(v)}" for k, v in m.items() if k not in ("total", "capacity") and v)
    what = (f"the {plan.mode} step needs {gib(m['total'])} per {layout.target.name} core ({parts}) but a core "
            f"has {gib(m['capacity'])}")
    changes: list[tuple[str, Plan]] = []
    n = experts(tr).per_layer  # MoE over data-parallel replicas: split the experts first (the least change)
    changes += [(f"ep={e}", replace(plan, ep=e)) for e in (2**k for k in range(1, 12))
                if n and e > plan.ep and n % e == 0 and plan.dp % e == 0]
    if plan.train:
        if plan.recompute != "full":
            changes.append(("recompute='full'", replace(plan, recompute="full")))
        if plan.dp > 1 and not plan.fsdp:
            changes.append(("fsdp=True", replace(plan, fsdp=True)))
            if plan.recompute != "full":
                changes.append(("fsdp=True and recompute='full'", replace(plan, fsdp=True, recompute="full")))
    elif not plan.precision:
        changes.append(("precision='w8' (8-bit weights)", replace(plan, precision="w8")))
    for text, p in changes:
        if mem(p)["total"] <= m["capacity"]:
            return f"{what}; the smallest change that fits: {text}"
    fits = lambda p: mem(p)["total"] <= m["capacity"]
    tps = [plan.tp * 2**k for k in range(1, 12) if plan.tp * 2**k <= layout.cores_per_instance]
    tp = next((t for t in tps if fits(replace(plan, tp=t))), None)
    pp = next((2**k * plan.pp for k in range(1, 10) if fits(replace(plan, pp=2**k * plan.pp))), None)
    options = [f"tp={tp}"] * (tp is not None) + [f"pp={pp}"] * (pp is not None)
    if options:
        return f"{what}; the smallest change that fits: {' or '.join(options)}"
    return f"{what}; no tensor- or pipeline-parallel degree fits it: it needs more cores per model copy"


def _on_tensor_engine(o: OpTime) -> bool:
    """Model FLOPs: TensorE's, and matmuls the device runs as host fallbacks (MoE grouped GEMMs) that a compiled
    program puts on TensorE."""
    return o.engine == "tensor" or (o.engine == "host" and op_info(o.op).rule is Rule.MATMUL)


def _micro(tr: Trace, plan: Plan) -> float:
    """Micro-batches per step on each data-parallel replica (gradient accumulation, or a pipeline's fill)."""
    return max(1.0, plan.batch_items / (tr.items * plan.dp)) if (plan.train and plan.batch_items) else 1.0


def _pipeline_ops(tr: Trace, lay: Layout, plan: Plan, slots: float) -> list[OpTime]:
    """Between stages, every slot: the activation [tokens, hidden] sent forward (and in training its gradient
    sent back), point to point between neighbouring stages, tp x dp cores apart (rank order above: across instances
    when a stage's replicas fill one); not overlapped."""
    attention = next((r for r in tr.recs if r.phase == "forward" and op_info(r.op).rule is Rule.ATTENTION), None)
    if attention is None:
        return []
    nbytes = attention.ins[0].nbytes / (plan.tp if plan.sp else 1)
    c = lay.collective("all_gather", 2 * nbytes, 2, stride=plan.tp * plan.dp)  # 2 ranks: each sends its half
    return [OpTime("send_recv", "pipeline", "collective", 0.0, c.bytes, c.time_s, c.bound, c.achieved,
                   slots * (2 if plan.train else 1))]


def _expert_ops(ex: Experts, lay: Layout, plan: Plan, slots: float) -> list[OpTime]:
    """Expert parallelism: every MoE layer sends its routed rows to the cores holding their experts and brings the
    results back (two all-to-alls over the ep replicas, tp cores apart), and in training the same for their
    gradients; each core of a TP group sends 1/tp of the rows. Balanced routing (each core receives as many rows
    as it sends); not overlapped with the expert GEMMs. A stage holds 1/pp of the layers."""
    out = []
    for nbytes in ex.dispatch:
        c = lay.collective("all_to_all", nbytes / plan.tp, plan.ep, stride=plan.tp)
        for phase in ("forward", "backward") if plan.train else ("forward",):
            out.append(OpTime("all_to_all", phase, "collective", 0.0, c.bytes / plan.pp, c.time_s / plan.pp,
                              c.bound, c.achieved, 2 * slots))
    return out


def cost(tr: Trace, layout: Layout, plan: Plan, price_per_hour: float | None = None) -> EstimateResult:
    """Cost a recorded step on `layout` under `plan`."""
    co = Coster(tr, layout, plan.tp, plan.sp, plan.execution == "compiled", plan.precision, plan.ep,
                {"forward": "prefill", "decode": "decode"}.get(plan.mode))
    micro, pp = _micro(tr, plan), plan.pp
    # a pipeline stage runs 1/pp of every micro-batch's work, over micro + bubble slots
    slots = micro + plan.bubble
    ops = [OpTime(x.cost.op if x.cost.engine == "collective" else x.rec.op, x.rec.phase, x.cost.engine,
                  x.cost.flops / pp, x.hbm_bytes / pp, x.time_s / pp, x.cost.bound, x.cost.achieved, slots,
                  _shapes(x.rec))
           for x in co.times(tr.recs)]
    if plan.ep > 1:
        ops += _expert_ops(co.experts, layout, plan, slots)
    if plan.train and plan.recompute != "none":
        ops += [replace(o, phase="recompute") for o in ops if o.phase == "forward"
                and (plan.recompute == "full" or op_info(o.op).rule is Rule.ATTENTION)]
    itemsize = tr.param_bytes / tr.param_count if tr.param_count else 4
    if pp > 1:
        ops += _pipeline_ops(tr, layout, plan, slots)
    if plan.train:
        ops += _optimizer_ops(tr, layout, plan, itemsize, micro)
    step = sum(o.time_s * o.count for o in ops)
    items, cores, t = tr.items * plan.dp * micro, plan.dp * plan.tp * pp, layout.target
    flops = micro * sum(o.flops for o in ops if o.phase in ("forward", "backward") and _on_tensor_engine(o))
    price = layout.price_per_hour if price_per_hour is None else price_per_hour
    per_hour = None if price is None else price * cores / layout.cores_per_instance
    return EstimateResult(
        target=t.name, instance=layout.instance, mode=plan.mode, execution=plan.execution, dp=plan.dp,
        tp=plan.tp, lnc=t.lnc, cores=cores, instances=math.ceil(cores / layout.cores_per_instance),
        micro_steps=micro,
        step_time_s=step, items_per_step=items, unit=tr.unit, items_per_s=items / step,
        mfu=flops / step / t.marketed_flops(_peak_class(plan, itemsize)),
        price_per_hour=price, price_source=layout.price_source if price_per_hour is None else "given",
        cost_per_hour=per_hour, cost_per_step=None if per_hour is None else per_hour * step / 3600,
        cost_per_million=None if per_hour is None else per_hour / (items / step * 3600) * 1e6,
        memory=_memory(tr, co, plan, itemsize, micro), ops=ops, precision=plan.precision,
        cores_per_instance=layout.cores_per_instance, pp=pp, ep=plan.ep)


def _peak_class(plan: Plan, itemsize: float) -> str:
    """The dtype whose dense peak is the MFU denominator: the one the matmuls run in."""
    if plan.precision == "fp8":
        return "float8"
    return "bfloat16" if itemsize <= 2 else "float32"


class GpuLayout(NamedTuple):
    """One way to lay the job out on GPUs: data-, tensor- and pipeline-parallel degrees."""

    dp: int
    tp: int
    pp: int


def compare_gpu(tr: Trace, res: EstimateResult, plan: Plan, gpu: str, *, count: int | None = None,
                tp: int | None = None, precision: str | None = "same",
                price_per_hour: float | None = None) -> EstimateResult:
    """The same step on a GPU instance type (`gpu`: h100 | h200 | b200 or an instance name), as a buyer would lay
    it out: `count` GPUs with tensor-parallel degree `tp` when given; otherwise, for inference, the cheapest
    tensor-parallel degree (1, 2, 4, 8) that fits and is at least as fast as the Trainium step (the fastest
    one when none is), and for training the cheapest fitting tensor-parallel degree, with or without the Trainium
    job's pipeline stages, on the Trainium job's share of GPU instances (at least one GPU), doubled until the
    step fits. precision: "same" (the Trainium run's), None (as traced), "fp8" or "w8"."""
    glay = Layout.of(gpu)
    gprec = plan.precision if precision == "same" else precision
    per_instance = glay.cores_per_instance

    def planned(g: GpuLayout) -> Plan:
        staged = {} if g.pp == plan.pp else {"pp": g.pp, "vpp": 1, "schedule": "1f1b"}
        return replace(plan, dp=g.dp, tp=g.tp, precision=gprec, ep=math.gcd(plan.ep, g.dp), **staged)

    if count is not None or tp is not None:
        gtp = tp or min(count or 1, per_instance)
        gcount = count or gtp
        if gcount % gtp:
            raise EstimateError(f"the GPU count ({gcount}) must be a multiple of the GPU tensor-parallel degree "
                             f"({gtp})")
        layouts = [GpuLayout(gcount // gtp, gtp, plan.pp)]
    elif plan.train:
        # As many GPUs as the Trainium job's share of instances (at least one); when no layout fits the step in
        # their memory, twice as many (data parallel shards ZeRO/FSDP state), up to 64x. A GPU job need not keep
        # Trainium's pipeline stages (8 H100s would not pipeline an 8B model over one micro-batch).
        first = max(1, round(res.cores * per_instance / res.cores_per_instance))
        for gpus in (first * 2**k for k in range(7)):
            layouts = [GpuLayout(gpus // (t * p), t, p) for p in sorted({1, plan.pp})
                       for t in (1, 2, 4, 8) if t <= per_instance and t * p <= gpus]
            if any(fit_error(tr, glay, planned(g)) is None for g in layouts):
                break
    else:
        layouts = [GpuLayout(1, t, plan.pp) for t in (1, 2, 4, 8) if t <= per_instance]
    glay.check_tp(max(g.tp for g in layouts))
    runs = [cost(tr, glay, planned(g), price_per_hour) for g in layouts if fit_error(tr, glay, planned(g)) is None]
    if not runs:
        r = cost(tr, glay, planned(layouts[-1]), price_per_hour)
        r.note = f"does not fit: {fit_error(tr, glay, planned(layouts[-1]))}"
        return r
    if len(runs) == 1:
        return runs[0]
    price = lambda r: r.cost_per_million if r.cost_per_million is not None else r.cores
    if plan.train:
        best = min(runs, key=price)
        best.note = (f"layout: the cheapest fitting of {len(runs)} on {best.cores} GPU(s), {best.instances} "
                     "instance(s)")
        return best
    fast = [r for r in runs if r.step_time_s <= res.step_time_s]
    best = min(fast, key=price) if fast else min(runs, key=lambda r: r.step_time_s)
    best.note = ("layout: the cheapest that fits and is as fast as the Trainium step" if fast else
                 "layout: none is as fast as the Trainium step; the fastest that fits")
    return best


def estimate(model: torch.nn.Module, example_inputs: Any, *, target: str = "trn2",
             instance: str | None = None, mode: str = "train", dp: int = 1, tp: int = 1,
             dtype: torch.dtype | None = None, batch_tokens: float | None = None,
             price_per_hour: float | None = None, lnc: int | None = None, execution: str = "compiled",
             sequence_parallel: bool | None = None, recompute: str = "none", optimizer: str | None = "adamw",
             zero1: bool = True, compare: str | None = "p5.48xlarge",
             precision: str | None = None, fsdp: bool = False, pp: int = 1, schedule: str = "1f1b",
             vpp: int = 1, ep: int = 1, check_memory: bool = True,
             gpu_count: int | None = None, gpu_tp: int | None = None, gpu_precision: str | None = "same",
             gpu_price: float | None = None) -> EstimateResult:
    """Model one step of `model` on `example_inputs` (one micro-batch per data-parallel rank) on Trainium.

    target: trn1 | trn2 | trn3 (or h100); instance: defaults to the target's largest instance. mode: "train"
    (forward + backward + gradient sync + optimizer), "forward", or "decode" (a forward whose inputs hold one
    new token per sequence and its cache: pass a callable building them, see costmodel.presets). dp, tp:
    data- and tensor-parallel degrees over logical cores (TP groups packed inside an instance). dtype: cast
    floating parameters and inputs (e.g. torch.bfloat16). batch_tokens: global batch per step in tokens (or
    samples); more than dp x the example's items means gradient accumulation. execution: "compiled" (fused
    kernels) or "eager" (one launched kernel per op). sequence_parallel (default: on for training with
    tp > 1), recompute ("none", "selective": attention, "full"), optimizer ("adamw", "sgd", None), zero1
    (optimizer state sharded over dp). price_per_hour overrides the instance price. compare: a GPU instance
    (or GPU: h100, h200, b200) to cost the same step on (same method; None to skip), laid out by compare_gpu
    with gpu_count, gpu_tp, gpu_precision and gpu_price. precision: None (as traced), "fp8" (matmuls in fp8,
    MFU against the fp8 peak) or "w8" (8-bit weights, 16-bit math; inference). fsdp: ZeRO-3 (weights and
    gradients sharded over dp too, gathered every micro-step). pp: pipeline stages (layers split evenly over
    pp x tp cores), schedule "1f1b" | "gpipe" | "interleaved" (with vpp virtual stages): the bubble is p - 1 (or
    (p - 1) / vpp) micro-step slots; batch_tokens sets the micro-batches. ep: expert parallelism for MoE models,
    dividing dp: each core holds 1/ep of every layer's experts and every MoE layer exchanges its routed tokens
    with two all-to-alls (four in training). check_memory: raise
    torch.OutOfMemoryError naming what does not fit in a core's memory and the smallest change that would (False:
    report `fits` only)."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise EstimateError(f"dtype={dtype!r}: expected a torch.dtype, e.g. torch.bfloat16 (or None: as the model is)")
    plan = Plan(mode, dp, tp, batch_tokens, sequence_parallel, execution, recompute, optimizer, zero1,
                precision, fsdp, pp, schedule, vpp, ep)
    lay = Layout.of(target, instance, lnc)
    lay.check_tp(tp)
    if price_per_hour is not None and not (math.isfinite(price_per_hour) and price_per_hour > 0):
        raise EstimateError(f"the price per instance-hour must be a finite number > 0, got {price_per_hour}")
    tr = trace(model, example_inputs, train=plan.train, dtype=dtype)
    if ep > 1 and (not (n := experts(tr).per_layer) or n % ep):
        raise EstimateError(f"expert parallelism splits whole experts: ep={ep} must divide the experts per layer "
                         f"({n or 'none: the model has no _grouped_mm experts'})")
    if check_memory and (message := fit_error(tr, lay, plan)):
        raise torch.OutOfMemoryError(f"does not fit: {message}")
    res = cost(tr, lay, plan, price_per_hour)
    if compare and lay.target.is_neuron:
        res.comparison = compare_gpu(tr, res, plan, compare, count=gpu_count, tp=gpu_tp, precision=gpu_precision,
                                     price_per_hour=gpu_price)
    return res
