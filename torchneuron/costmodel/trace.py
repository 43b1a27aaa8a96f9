"""Record a model's step as ATen ops with shapes and dtypes, without computing anything.

The model runs on meta copies of its parameters (so a 70B model needs no memory), with attention as one fused
op. A TorchDispatchMode records every op, and tracks how each tensor would be laid out under Megatron-style
tensor parallelism:
  W  a parameter (sharded across the TP group),
  R  replicated, S  sharded, P  partial sums awaiting a reduction.
A matmul of a replicated activation with a weight shards the weight's output dimension (column parallel,
result S); of a sharded activation, its contraction dimension (row parallel, result P). Activation x
activation matmuls and attention on S inputs split heads / rows. A P tensor is reduced (an all-reduce record)
before any op that is not linear in it. Backward follows from the same rules. A mixture-of-experts router (the
matmul whose output decides the rows each expert GEMM gets) is replicated, as NxD's, Megatron's and vLLM's are:
the routing and the dispatched rows are then R, each expert GEMM pair is column- then row-parallel and the layer
has one reduction. A low-rank down-projection (a column-parallel matmul narrower than its input whose output is
normalized and projected up again: DeepSeek's multi-head latent attention) is replicated too, as vLLM's
DeepseekV2Attention and Megatron's MLA are: the latent is whole on every core, the up-projection column-parallel by
heads. The records are independent of the TP degree: costing applies it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.optable import Rule, base_name, op_info
from .ops import T


class OpLayout(NamedTuple):
    """How tensor parallelism lays out one op's outputs: their placement (W/R/S/P) and which dimension of the work
    it divides (m, n, k, b, heads, sp, all; None: not divided)."""

    placement: str
    divides: str | None


@dataclass
class Rec:
    """One recorded op. `shard` says what the TP degree divides when it is costed: a matmul dimension
    ("b", "m", "k", "n"), "heads", "all" (sharded data), "sp" (replicated data, divided only under sequence
    parallelism), or None (every rank does the whole op)."""

    op: str
    phase: str
    ins: list[T]
    outs: list[T]
    in_ids: list[int]
    out_ids: list[int]
    attrs: dict = field(default_factory=dict)
    shard: str | None = None


@dataclass
class Trace:
    recs: list[Rec]
    placement: dict[int, str]  # tensor id -> W / R / S / P (last known; views share their base's)
    specs: dict[int, T]  # tensor id -> shape and dtype
    param_bytes: int
    param_count: int
    input_bytes: int  # bytes of the example inputs (e.g. a KV cache)
    items: int  # tokens (or samples) one step processes
    unit: str


def _spec(t: torch.Tensor) -> T:
    return T(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."))


def _attrs(func, args, kwargs) -> dict:
    """The op's small non-tensor arguments by schema name (groups, transposed, is_causal, output_mask)."""
    named = dict(zip((arg.name for arg in func._schema.arguments), args, strict=False)) | kwargs
    ok = (bool, int, float)
    small = lambda v: isinstance(v, ok) or isinstance(v, (list, tuple)) and all(isinstance(e, ok) for e in v)
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in named.items() if small(v)}


def _kind(op: str) -> str:
    return {Rule.MATMUL: "mm", Rule.CONV: "conv", Rule.ATTENTION: "attn"}.get(op_info(op).rule, "other")


_NORMS = frozenset("mean var var_mean std std_mean native_layer_norm _fused_rms_norm linalg_vector_norm norm".split())
_FROM_SHAPE = frozenset("zeros_like ones_like full_like empty_like new_zeros new_ones new_full new_empty".split())


class Recorder(TorchDispatchMode):
    """Records ATen ops with shapes, dtypes, producers/consumers and tensor-parallel layout."""

    def __init__(self, weights: set[int]):
        super().__init__()
        self.recs: list[Rec] = []
        self.phase = "forward"
        self.weights = weights
        self.place: dict[int, str] = dict.fromkeys(weights, "W")  # by storage: the base tensor of views
        self.made: dict[int, list[Rec]] = {}  # tensor id -> the recs that wrote it (in-place ops too)
        self.routers: set[int] = set()  # sharded weights found routing rows to experts (trace replicates them)
        self.downs: set[int] = set()  # sharded weights found projecting down to a normalized latent (replicated too)
        self.zeros: set[int] = set()  # tensors made as zeros and not written since: valid partial sums too
        self.base: dict[int, int] = {}  # view id -> id of the tensor it views
        self.partial: dict[int, T] = {}  # P tensor -> the tensor whose reduction it stands for (narrowest)
        self.specs: dict[int, T] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique for the length of the trace

    def _key(self, t: torch.Tensor) -> int:
        return self.base.get(id(t), id(t))

    def _note(self, t: torch.Tensor, placement: str | None = None) -> int:
        i = id(t)
        if i not in self.specs:
            self._alive.append(t)
            self.specs[i] = _spec(t)
        if placement is not None:
            self.place[self._key(t)] = placement
        return i

    def _reduce(self, t: torch.Tensor) -> None:
        """A partial-sum tensor is consumed by an op that needs the sum: an all-reduce over the TP group (of
        the tensor the partial sums were made as: a later cast does not make the reduction wider)."""
        i, k = self._note(t, "R"), self._key(t)
        spec = self.partial.pop(k, self.specs[i])
        self.recs.append(Rec("all_reduce", self.phase, [spec], [spec], [i], [i]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "aten":
            return func(*args, **kwargs)
        op = base_name(func._overloadpacket.__name__)
        tins = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        pl = [self.place.get(self._key(x), "R") for x in tins]
        if func.is_view or op_info(op).engine == "free":
            out = func(*args, **kwargs)
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor) and tins and o is not tins[0]:
                    self.base[id(o)] = self._key(tins[0])
                    self._note(o)
            return out
        kind = _kind(op)
        if op in _FROM_SHAPE:  # reads its input's shape only: a partial input needs no reduction
            pl = [("R" if p == "P" else p) for p in pl]
        linear = op_info(op).tp_linear  # how a partial sum passes through the op
        parts = [x for x, p in zip(tins, pl, strict=True) if p == "P"]
        if op == "mul" and len(parts) > 1 and "S" not in pl:  # linear in each factor: reduce all but the widest
            widest = max(parts, key=lambda x: self.partial.get(self._key(x), self.specs[self._note(x)]).nbytes)
            for x in parts:
                if self._key(x) != self._key(widest):
                    self._reduce(x)
            pl = [self.place.get(self._key(x), "R") for x in tins]
        scaling = linear == "one" and pl.count("P") == 1 and "S" not in pl
        scatter = linear == "into" and pl[-1] == "P" and (pl[0] == "P" or self._key(tins[0]) in self.zeros) \
            and "S" not in pl  # a gather's backward or an MoE combine: rows of partial sums added into zeros
        summed = linear == "all" and set(pl) <= {"P", "R"}  # a replicated term is 1/tp of it on each rank
        if "P" in pl and not (scaling or scatter or summed):
            for x, p in zip(tins, pl, strict=True):
                if p == "P":
                    self._reduce(x)
            pl = [("R" if p == "P" else p) for p in pl]
        out = func(*args, **kwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        layout = self._layout(op, kind, tins, ["P", *pl[1:]] if scatter else pl)
        result, shard = layout.placement, layout.divides
        ids = [self._note(x) for x in tins]
        out_ids = [self._note(o, result) for o in outs]
        if result == "P":
            made = [self.partial.get(self._key(x), self.specs[i])
                    for x, i, p in zip(tins, ids, pl, strict=True) if p == "P"]
            for o, i in zip(outs, out_ids, strict=True):  # one partial input: reducing it first is as good
                same = made if len(made) == 1 else [t for t in made if t.numel == self.specs[i].numel]
                self.partial[self._key(o)] = min([*same, self.specs[i]], key=lambda t: t.nbytes)
        rec = Rec(op, self.phase, [self.specs[i] for i in ids], [self.specs[i] for i in out_ids], ids, out_ids,
                  _attrs(func, args, kwargs), shard)
        self.recs.append(rec)
        for o in outs:
            self.made.setdefault(self._key(o), []).append(rec)
            (self.zeros.add if op in ("zeros", "zeros_like", "new_zeros") else self.zeros.discard)(self._key(o))
        if op == "_grouped_mm" and len(tins) > 2:
            self._find_routers(tins[2])
        if kind == "mm" and shard == "k" and self.phase == "forward":  # row parallel: where did its input split?
            self._find_down_projections([x for x, p in zip(tins, pl, strict=True) if p == "S"])
        return out

    def _find_routers(self, offsets: torch.Tensor) -> None:
        """The router of an expert GEMM: the nearest matmuls up the dataflow of its group offsets (through top-k,
        sort and counting). Their weights, where sharded, join `routers` (traced params, through casts)."""
        stack, seen = [self._key(offsets)], set()
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            for r in self.made.get(k, ()):
                keys = [self.base.get(i, i) for i in r.in_ids]
                if _kind(r.op) == "other":
                    stack += keys
                elif _kind(r.op) == "mm":
                    self.routers |= {p for x in keys for p in self._params(x)}

    def _find_down_projections(self, acts: list[torch.Tensor]) -> None:
        """The low-rank down-projections before a row-parallel matmul: the nearest column-parallel matmuls up its
        input's dataflow whose outputs are narrower than their inputs and were normalized on the way (a norm over a
        split row would need the whole row). Their weights join `downs`."""
        stack, seen = [(self._key(x), False) for x in acts], set()
        while stack:
            k, normed = stack.pop()
            if (k, normed) in seen:
                continue
            seen.add((k, normed))
            for r in self.made.get(k, ()):
                keys = [self.base.get(i, i) for i in r.in_ids]
                if _kind(r.op) == "other":
                    stack += [(x, normed or r.op in _NORMS) for x in keys]
                elif _kind(r.op) == "mm" and normed and r.shard == "n":
                    act = r.ins[0 if r.op == "linear" else op_info(r.op).operands[0]]
                    if r.outs[0].shape[-1] < act.shape[-1]:
                        self.downs |= {p for x in keys for p in self._params(x)}

    def _params(self, k: int) -> set[int]:
        """The sharded parameters a weight-placed tensor is made from (itself, or those a cast read)."""
        if k in self.weights or self.place.get(k) != "W":
            return {k} & self.weights
        return {p for r in self.made.get(k, ()) for i in r.in_ids for p in self._params(self.base.get(i, i))}

    @staticmethod
    def _layout(op: str, kind: str, tins: list[torch.Tensor], pl: list[str]) -> OpLayout:
        """How tensor parallelism lays out this op's outputs."""
        if kind in ("mm", "conv"):
            ia, ib = op_info(op).operands
            if kind == "conv" or op == "linear":  # the weight is the second operand, its rows the outputs
                ia, ib = (0, 1) if op != "convolution_backward" else (1, 2)
            pa, pb = pl[ia], pl[ib]
            batched = tins[ia].dim() > 2 and kind == "mm"
            if "W" in (pa, pb):
                act = pb if pa == "W" else pa
                if act == "W":
                    return OpLayout("R", None)
                if act == "S":
                    return OpLayout("P", "k")
                return OpLayout("S", "n" if pb == "W" or kind == "conv" else "m")
            if pa == "S" and pb == "S":
                return OpLayout("S", "b") if batched else OpLayout("P", "k")
            if "S" in (pa, pb):
                return OpLayout("S", "b" if batched else ("m" if pa == "S" else "n"))
            return OpLayout("R", None)
        if kind == "attn":
            return OpLayout("S", "heads") if "S" in pl else OpLayout("R", None)
        if "P" in pl:  # linear ops on partial sums: as if after a reduce-scatter under sequence parallelism
            return OpLayout("P", "sp")
        if "W" in pl and op_info(op).engine == "gpsimd":  # lookup in a vocab-sharded table: partial rows
            return OpLayout("P", None)
        if "S" in pl:
            return OpLayout("S", "all")
        if pl and all(p == "W" for p in pl):  # casts and updates of weights stay weights
            return OpLayout("W", "all")
        return OpLayout("R", "sp")


def _meta(x: Any, dtype: torch.dtype | None) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    dt = dtype if dtype is not None and x.is_floating_point() else x.dtype
    return torch.empty(x.shape, dtype=dt, device="meta")


class FusedAttention(TorchFunctionMode):
    """Runs F.scaled_dot_product_attention as one fused (flash) attention op, as an accelerator does: on the
    meta device PyTorch would decompose it into matmuls and a softmax over the whole score matrix. Attention
    with dropout stays decomposed."""

    _ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kw = dict(zip(self._ARGS, args[3:], strict=False)) | kwargs if func is F.scaled_dot_product_attention else {}
        if func is not F.scaled_dot_product_attention or kw.get("dropout_p", 0.0):
            return func(*args, **kwargs)  # no fused kernel with dropout is assumed: it runs decomposed
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        q, k, v = args[:3]
        dv = v.shape[-1]
        if dv < q.shape[-1]:  # values narrower than queries (DeepSeek's MLA): padded to the query width, as
            v = F.pad(v, (0, q.shape[-1] - dv))  # flash kernels take one head dim; the extra columns are cut off
        out = flash(q, k, v, 0.0, kw.get("is_causal", False), attn_mask=kw.get("attn_mask"),
                    scale=kw.get("scale"))[0]
        return out[..., :dv] if dv < q.shape[-1] else out


def _loss(out: Any) -> torch.Tensor:
    """What backward starts from: a `loss` attribute (Hugging Face), else the first scalar among the outputs
    (e.g. (logits, loss)), else the sum of the first floating output."""
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    leaves = [t for t in pytree.tree_leaves(getattr(out, "logits", out))
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    scalars = [t for t in leaves if t.dim() == 0]
    return scalars[0] if scalars else leaves[0].sum()


def _count(inputs: Any) -> tuple[int, str]:
    """Tokens (integer inputs, e.g. input_ids) or samples (the batch dimension of the first float input)."""
    leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    ints = [t for t in leaves if not t.is_floating_point() and t.dtype != torch.bool]
    if ints:
        return ints[0].numel(), "tokens"
    return (leaves[0].shape[0] if leaves and leaves[0].dim() else 1), "samples"


def trace(model: torch.nn.Module, example_inputs: Any, *, train: bool = True,
          dtype: torch.dtype | None = None) -> Trace:
    """Run one step of `model` on meta tensors and record it: forward, then backward when `train`. The model's
    own parameters are untouched (the step runs on meta copies) and may live on any device, meta included.

    `example_inputs`: a tensor, a tuple of positional arguments, a dict of keyword arguments, or a callable
    returning one of those (called on the meta device: build caches or other objects there)."""
    with torch.device("meta"):
        params = {n: _meta(p, dtype).requires_grad_(train and p.requires_grad)
                  for n, p in model.named_parameters()}
        buffers = {n: _meta(b, dtype) for n, b in model.named_buffers()}
        raw = example_inputs() if callable(example_inputs) else example_inputs
        inputs = pytree.tree_map(lambda x: _meta(x, dtype), raw)
        if isinstance(inputs, dict):
            args, kwargs = (), inputs
        else:
            args, kwargs = ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)), {}
        def record(weights: set[int]) -> Recorder:
            rec = Recorder(weights)
            with FusedAttention(), rec, torch.enable_grad() if train else torch.no_grad():
                out = torch.func.functional_call(model, {**params, **buffers}, args, kwargs)
                if train:
                    rec.phase = "backward"
                    _loss(out).backward()
            return rec

        weights = {id(p) for p in params.values()}
        was_training = model.training
        model.train(train)  # no dropout when estimating inference
        try:
            rec = record(weights)
            routers = rec.routers  # known only once their expert GEMMs run: record again with them replicated,
            if routers:  # and look for down-projections there (after a split router the layout was wrong)
                rec = record(weights - routers)
            if rec.downs:  # known only once the matmuls after them run, too
                rec = record(weights - routers - rec.downs)
        finally:
            model.train(was_training)
    input_leaves = [t for t in pytree.tree_leaves(raw) if isinstance(t, torch.Tensor)] + _cache_leaves(raw)
    items, unit = _count(raw)
    placement = {i: rec.place.get(rec.base.get(i, i), "R") for i in rec.specs}
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    return Trace(rec.recs, placement, rec.specs, nbytes(params.values()),
                 sum(p.numel() for p in params.values()), nbytes(input_leaves), items, unit)


def fx_trace(gm: torch.fx.GraphModule) -> Trace:
    """The records of an FX graph whose nodes carry `meta["val"]` (a compiled kernel's graph), replicated. A
    view node stands for the node it views."""
    recs, specs, alias = [], {}, {}
    val = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a
    for n in gm.graph.nodes:
        outs = [t for t in pytree.tree_leaves(val(n)) if isinstance(t, torch.Tensor)]
        nodes = [alias.get(id(a), id(a)) for a in pytree.tree_leaves((n.args, n.kwargs))
                 if isinstance(a, torch.fx.Node) and alias.get(id(a), id(a)) in specs]
        op = n.target if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) else None
        if op is not None and (op.is_view or op_info(op).engine == "free") and nodes:
            alias[id(n)] = nodes[0]
            continue
        if outs:
            specs[id(n)] = _spec(outs[0])
        if op is not None:
            args, kwargs = pytree.tree_map(val, (n.args, n.kwargs))
            name = base_name(op._overloadpacket.__name__)
            recs.append(Rec(name, "forward", [specs[i] for i in nodes], [_spec(t) for t in outs], nodes,
                            [id(n)] if outs else [], _attrs(op, args, kwargs)))
    return Trace(recs, dict.fromkeys(specs, "R"), specs, 0, 0, 0, 0, "samples")


def _cache_leaves(inputs: Any) -> list[torch.Tensor]:
    """Tensors held by a Hugging Face cache object among the inputs (its KV tensors)."""
    found: list[torch.Tensor] = []
    for v in (inputs.values() if isinstance(inputs, dict) else ()):
        for layer in getattr(v, "layers", ()):
            found += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return found

