"""Adaptive eager fusion: a run of queued elementwise and reduction ops on one stream becomes one host kernel.

The device's stream worker collects a run of queued ops whose names `fusable()` accepts (the op table's `fuse`
field) into a group: `Node`s whose arguments are group inputs (`Input`), results of earlier nodes (`Value`) or
constants. `compile_group` traces the nodes on fake tensors, decomposes them with the compiler's table and has
Inductor's CPU code generator compile them, each requested result stored straight into a preallocated buffer by a
final `copy_` (Inductor lowers it as a store of the fused loop; no extra copy). Compiled groups are cached in memory
by their whole signature (ops, constants with their types, input specs, requested outputs) and their generated code
on disk in the compile cache (compiler/cache.py), so the same group always runs the same code. A group that cannot
be compiled returns None (the ops then run unfused) and is counted in `stats()`.

Off under `TORCHNEURON_EAGER_FUSION=0` and under `torch.use_deterministic_algorithms(True)` (as AWS's adaptive
eager execution): `compile_group` then returns None. Importing this module is cheap: Inductor loads at the first
compile."""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import torch

from ..hardware import config
from ..runtime.optable import op_info


@dataclass(frozen=True)
class Spec:
    """A group input or result: what the kernel is specialised on."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Input:
    """Group input `k` (an argument of a node)."""

    k: int


@dataclass(frozen=True)
class Value:
    """Result `index` of the group's earlier node `node` (an argument of a node, or a requested output)."""

    node: int
    index: int = 0


@dataclass(frozen=True)
class Node:
    """One queued op: `op` is its qualified name with overload ("aten::add.Tensor", "aten::relu"); `args` and
    `kwargs` hold Input, Value or constants (int, float, bool, None, torch.dtype, lists/tuples of these)."""

    op: str
    args: tuple
    kwargs: tuple[tuple[str, object], ...] = ()


@dataclass
class Stats:
    """What fusion did in this process (the porting report reads it): distinct groups compiled, cache hits, fused
    kernel runs, groups that could not be compiled (run unfused) and why the last one failed, groups refused
    because fusion was off, and sightings of a signature not yet seen `after` times (run unfused)."""

    compiled: int = 0
    cache_hits: int = 0
    runs: int = 0
    failures: int = 0
    disabled: int = 0
    cold: int = 0
    last_failure: str | None = None


_STATS = Stats()
_CACHE: dict[tuple, FusedKernel | None] = {}
_SIGHTINGS: dict[tuple, int] = {}  # signatures seen but not compiled yet (compile_group's `after`)
_LOCK = threading.Lock()  # one compile at a time (stream workers release the GIL inside Inductor's build)
ABI = 1  # bump when the meaning of a cached group changes


def stats() -> Stats:
    return replace(_STATS)


def enabled() -> bool:
    """Fusion is on unless TORCHNEURON_EAGER_FUSION=0 or deterministic algorithms are requested."""
    cfg = config.current_or_none()  # TORCHNEURON_EAGER_FUSION is read once, at registration
    return cfg is not None and cfg.eager_fusion and not torch.are_deterministic_algorithms_enabled()


def _overload(op: str) -> torch._ops.OpOverload | None:
    ns, _, rest = op.partition("::")
    packet, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")
    except (AttributeError, RuntimeError):
        return None


@cache
def fusable(op: str) -> bool:
    """May `op` ("aten::add.Tensor") join a fused group: the op table says it fuses, and this overload is a
    functional, deterministic op (in-place and out= variants write memory the group does not own; random draws
    keep the device generator's numbers)."""
    overload = _overload(op)
    return (overload is not None and op_info(op).fuse and not overload._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in overload.tags)


class FusedKernel:
    """A compiled group: `kernel(inputs, outs)` writes the requested results into `outs` (CPU tensors with
    `out_specs`), keeping no reference to either list. `source`: Inductor's generated code."""

    def __init__(self, call: Callable[[list], Any], out_specs: tuple[Spec, ...], source: str):
        self.call, self.out_specs, self.source = call, out_specs, source

    def __call__(self, inputs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        self.call([*inputs, *outs])  # Inductor's boxed call checks every size and stride, then clears its list
        _STATS.runs += 1


def _typed(a: Any) -> Any:
    """A constant with its type in the key: 2 and 2.0 and True promote differently, 0.0 and -0.0 differ (a list
    and a tuple of ints mean the same to an op)."""
    t = type(a)
    if t is Input:
        return (t, a.k)
    if t is Value:
        return (t, a.node, a.index)
    if t is list or t is tuple:
        return ("sequence", *map(_typed, a))
    if t is float or t is int or t is bool:
        return (t, repr(a) if t is float else a)
    if isinstance(a, torch.Tensor):
        raise TypeError("a tensor constant: pass it as a group input")
    return a


def _key(nodes: tuple[Node, ...], inputs: tuple[Spec, ...], outputs: tuple[Value, ...]) -> tuple:
    """The group's signature, and the thread count Inductor's CPU code generator splits its loops for. Plain
    tuples (hashed in C): a group is looked up at every launch."""
    return (tuple((n.op, _typed(n.args), _typed(n.kwargs)) for n in nodes),
            tuple((tuple(s.sizes), tuple(s.strides), s.dtype) for s in inputs),
            tuple((v.node, v.index) for v in outputs), torch.get_num_threads())


def compile_group(nodes: tuple[Node, ...], inputs: tuple[Spec, ...], outputs: tuple[Value, ...], *,
                  after: int = 1) -> Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None:
    """The fused kernel of a group (cached by signature), or None when fusion is off, the group cannot be
    compiled, or its signature has been seen fewer than `after` times (each counted; the caller runs the ops
    unfused). `after` > 1 spends a compile (seconds) only on groups that recur, as a training step's do. Never
    raises."""
    if not enabled():
        _STATS.disabled += 1
        return None
    try:
        key = _key(nodes, inputs, outputs)
        hash(key)
    except TypeError as e:
        return _failed(None, f"unsupported constant ({e})")
    if key in _CACHE:
        _STATS.cache_hits += 1
        return _CACHE[key]
    with _LOCK:
        if key in _CACHE:
            _STATS.cache_hits += 1
            return _CACHE[key]
        seen = _SIGHTINGS[key] = _SIGHTINGS.get(key, 0) + 1
        if seen < after:
            _STATS.cold += 1
            return None
        _SIGHTINGS.pop(key)
        try:
            kernel = _compile(tuple(Spec(*s) for s in key[1]), tuple(Value(*v) for v in key[2]), nodes)
        except Exception as e:  # noqa: BLE001  (any failure means: run these ops unfused)
            return _failed(key, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        _CACHE[key] = kernel
        _STATS.compiled += 1
        return kernel


def _failed(key: tuple | None, why: str) -> None:
    _STATS.failures += 1
    _STATS.last_failure = why
    if key is not None:
        _CACHE[key] = None  # a signature that failed once is not compiled again
    return None


def _interpret(nodes: tuple[Node, ...], ops: list, args: tuple) -> list[tuple]:
    """Run the nodes one by one on `args` (the group inputs): each node's results, as a tuple."""
    def value(a: Any) -> Any:
        if isinstance(a, Input):
            return args[a.k]
        if isinstance(a, Value):
            if not 0 <= a.node < len(results):
                raise ValueError(f"Value({a.node}) does not name an earlier node")
            return results[a.node][a.index]
        if isinstance(a, (list, tuple)):
            return type(a)(value(x) for x in a)
        return a

    results: list[tuple] = []
    for node, op in zip(nodes, ops, strict=True):
        r = op(*value(tuple(node.args)), **{k: value(v) for k, v in node.kwargs})
        results.append(tuple(r) if isinstance(r, (tuple, list)) else (r,))
    return results


def _compile(inputs: tuple[Spec, ...], outputs: tuple[Value, ...], nodes: tuple[Node, ...]) -> FusedKernel:
    from torch._inductor import config as inductor_config

    # Eager rounds every op's bfloat16/float16 result: the trace marks each op's result, Inductor rounds it.
    with inductor_config.patch(emulate_precision_casts=True):
        return _build(*_trace(inputs, outputs, nodes), inputs)


def _trace(inputs: tuple[Spec, ...], outputs: tuple[Value, ...], nodes: tuple[Node, ...]) -> tuple:
    """The group as an aten graph over (inputs..., out buffers...) ending in a copy_ into each buffer, the fake
    example arguments, and the specs of the results (what the unfused ops would return)."""
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from .passes import decompositions

    if not nodes or not outputs:
        raise ValueError("an empty group")
    for node in nodes:
        if not fusable(node.op):
            raise ValueError(f"{node.op} is not fusable")
    ops = [_overload(n.op) for n in nodes]
    if any(not 0 <= a.k < len(inputs) for n in nodes for a in (*n.args, *dict(n.kwargs).values())
           if isinstance(a, Input)):
        raise ValueError("an Input outside the group's inputs")
    n_in = len(inputs)

    def run(*args: torch.Tensor) -> tuple:
        results = _interpret(nodes, ops, args[:n_in])
        for out, v in zip(args[n_in:], outputs, strict=True):
            torch.ops.aten.copy_.default(out, results[v.node][v.index])
        return ()

    with FakeTensorMode():
        ins = [torch.empty_strided(s.sizes, s.strides, dtype=s.dtype) for s in inputs]
        results = _interpret(nodes, ops, tuple(ins))
        vals = [results[v.node][v.index] for v in outputs]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            raise ValueError("a requested output is not a tensor")
        out_specs = tuple(Spec(tuple(v.shape), tuple(v.stride()), v.dtype) for v in vals)
        outs = [torch.empty_strided(s.sizes, s.strides, dtype=s.dtype) for s in out_specs]
        with torch.no_grad():
            gm = make_fx(run, decomposition_table=decompositions())(*ins, *outs)
        example = [*ins, *outs]
    return gm, example, out_specs


def _build(gm: Any, example: list, out_specs: tuple[Spec, ...], inputs: tuple[Spec, ...]) -> FusedKernel:
    """Inductor's code for the traced group, from the compile cache or compiled now (and stored there)."""
    from torch._inductor.codecache import PyCodeCache

    from .cache import Cache, digest
    from .kernel import _inductor, _target

    disk = Cache()
    key = digest({"eager_fusion": ABI, "graph": gm.code, "inputs": repr(inputs), "outputs": repr(out_specs),
                  "target": _target()})
    with disk.inductor_dir():
        entry = disk.load(key)
        if entry is not None:
            return FusedKernel(PyCodeCache.load(entry["source"]).call, out_specs, entry["source"])
        call, _, source = _inductor(gm, example, {"is_inference": True})
        if call is None:  # no constants held by the module: it reloads from its source text
            call = PyCodeCache.load(source).call
            disk.store(key, {"graph": gm.code, "source": source, "output_strides": [s.strides for s in out_specs]})
    return FusedKernel(call, out_specs, source)
