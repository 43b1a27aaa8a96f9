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
from typing import Any, NamedTuple

import torch

from ..hardware import config
from ..runtime import patches
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


def install() -> None:
    """Hand the stream workers the fusion entry points (torchneuron's import does; this module stays light). Under
    TORCHNEURON_EAGER_FUSION=0 nothing is installed, so queued launches carry nothing and workers never take the
    GIL for fusion."""
    from .. import _C

    cfg = config.current_or_none()
    if cfg is not None and cfg.eager_fusion:
        _C._set_eager_fusion(fusable, lambda ops: run_queued([QueuedOp(*q) for q in ops]))


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
        dynamo = _dynamo_compile_lock()
        if not dynamo.acquire(blocking=False):  # torch.compile is compiling on another thread: not now
            _STATS.cold += 1
            return None
        try:
            _SIGHTINGS.pop(key)
            kernel = _compile(tuple(Spec(*s) for s in key[1]), tuple(Value(*v) for v in key[2]), nodes)
        except Exception as e:  # noqa: BLE001  (any failure means: run these ops unfused)
            return _failed(key, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        finally:
            dynamo.release()
        _CACHE[key] = kernel
        _STATS.compiled += 1
        return kernel


AFTER = 3  # sightings of a group's signature before the stream worker compiles it (a step's groups recur)


class QueuedOp(NamedTuple):
    """One queued kernel as the stream worker hands it over: its qualified name with overload, its arguments
    (CPU views of device memory, Python numbers for wrapped scalars, constants) and the CPU views of the results
    its launch handed out."""

    op: str
    args: list
    outs: list[torch.Tensor]


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of `t`'s storage: two tensors over overlapping storage are treated as one memory."""
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _overlaps(a: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    return a[0] < a[1] and any(a[0] < b[1] and b[0] < a[1] for b in spans)


def run_queued(ops: list[QueuedOp]) -> int:
    """The stream worker's entry (csrc/queue.cpp): fuse the longest leading run of `ops` into one kernel and run it.
    Returns how many ops it ran (0: none; the worker runs the rest one by one). Never raises.

    A result whose memory a later op of the run was handed (Python freed it, the allocator gave its block again) is
    read only inside the run (every reader was launched before the free), so it lives in registers and is not
    stored; every other result is. A run ends before an op that reads a view of an earlier result (only whole
    results flow through a group) or whose results share memory with the run's inputs or other results. The group
    compiles at its AFTER-th sighting."""
    try:
        return _run_queued(ops)
    except Exception as e:  # noqa: BLE001  (any failure means: run these ops unfused)
        _failed(None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        return 0


@dataclass
class _Result:
    value: Value
    out: torch.Tensor
    span: tuple[int, int]
    stored: bool = True


class _Group:
    """A run of queued ops being turned into Nodes: group inputs are deduplicated by (address, sizes, strides,
    dtype); an argument equal to an earlier op's result becomes its Value."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.inputs: list[torch.Tensor] = []
        self.input_ids: dict[tuple, int] = {}
        self.in_spans: list[tuple[int, int]] = []
        self.produced: dict[tuple, Value] = {}
        self.results: list[_Result] = []

    @staticmethod
    def meta(t: torch.Tensor) -> tuple:
        return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)

    def add(self, q: QueuedOp, overload: torch._ops.OpOverload) -> bool:
        """Append `q` as the next node, or leave the group as it was and say no."""
        new_inputs: dict[tuple, torch.Tensor] = {}
        out_spans = [r.span for r in self.results]
        clash = False

        def arg(a: Any) -> Any:
            nonlocal clash
            if isinstance(a, (list, tuple)):
                return type(a)(arg(x) for x in a)
            if not isinstance(a, torch.Tensor):
                return a
            m = self.meta(a)
            if m in self.produced:
                return self.produced[m]
            clash |= _overlaps(_extent(a), out_spans)  # a view of an earlier result
            if m in self.input_ids:
                return Input(self.input_ids[m])
            new_inputs.setdefault(m, a)
            return Input(len(self.inputs) + list(new_inputs).index(m))

        schema = overload._schema.arguments
        args = tuple(arg(v) for a, v in zip(schema, q.args, strict=False) if not a.kwarg_only)
        kwargs = tuple((a.name, arg(v)) for a, v in zip(schema, q.args, strict=False) if a.kwarg_only)
        spans = [_extent(o) for o in q.outs]
        in_spans = self.in_spans + [_extent(t) for t in new_inputs.values()]
        if clash or any(_overlaps(sp, in_spans + spans[:j]) for j, sp in enumerate(spans)):
            return False
        for r in self.results:
            r.stored &= not any(_overlaps(sp, [r.span]) for sp in spans)  # its block was handed out again
        for m, t in new_inputs.items():
            self.input_ids[m] = len(self.inputs)
            self.inputs.append(t)
        self.in_spans = in_spans
        for j, (o, sp) in enumerate(zip(q.outs, spans, strict=True)):
            self.produced[self.meta(o)] = Value(len(self.nodes), j)
            self.results.append(_Result(Value(len(self.nodes), j), o, sp))
        self.nodes.append(Node(q.op, args, kwargs))
        return True


def _run_queued(ops: list[QueuedOp]) -> int:
    if not enabled():
        _STATS.disabled += 1
        return 0
    group = _Group()
    for q in ops:
        overload = _overload(q.op)
        if overload is None or not fusable(q.op) or not group.add(q, overload):
            break
    if len(group.nodes) < 2:
        return 0
    wanted = [r for r in group.results if r.stored]
    kernel = compile_group(tuple(group.nodes), tuple(Spec(tuple(t.shape), t.stride(), t.dtype) for t in group.inputs),
                           tuple(r.value for r in wanted), after=AFTER)
    if kernel is None:
        return 0
    outs = [r.out for r in wanted]
    if any(s != Spec(tuple(o.shape), o.stride(), o.dtype) for s, o in zip(kernel.out_specs, outs, strict=True)):
        return _failed(None, "the fused results' layout differs from the launched ones") or 0
    kernel(group.inputs, outs)
    return len(group.nodes)


def _dynamo_compile_lock() -> threading.RLock:
    """Dynamo's compile lock: Inductor's global state is not meant for two compiles at once, and a stream worker
    compiles while the host thread may be in torch.compile. Taken without waiting (a host thread holding it may be
    waiting for this very worker's stream)."""
    from torch._dynamo import convert_frame

    return convert_frame.compile_lock


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


# Inductor's Python binding of a CPU kernel holds the GIL while the loop runs; fused groups and compiled graphs run on
# a stream worker, and holding the GIL there would stop the host thread from launching (the overlap async execution
# is for).
_GIL_FREE_CALL = ("auto parsed = std::make_tuple({}); {{ struct NoGil {{ PyThreadState* s = PyEval_SaveThread();"
                  " ~NoGil() {{ PyEval_RestoreThread(s); }} }} nogil; std::apply(kernel, parsed); }} Py_RETURN_NONE;")


def _gil_free_bindings(done: patches.Applied) -> None:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    done.replace(CppPythonBindingsCodeCache, "call_entry_function", _GIL_FREE_CALL)


GIL_FREE_KERNELS = patches.declare(
    "gil-free-kernels", "torch._inductor.codecache.CppPythonBindingsCodeCache.call_entry_function (while a fused "
    "group or a compiled graph's kernel compiles or loads)", "a kernel's loop runs without the GIL, so the host "
    "thread keeps launching while a stream worker runs it (its binding is a different source, so a different cache "
    "entry)", "tests/test_eager_fusion.py::test_a_fused_kernel_runs_without_the_gil", _gil_free_bindings,
    when="on demand")


def _build(gm: Any, example: list, out_specs: tuple[Spec, ...], inputs: tuple[Spec, ...]) -> FusedKernel:
    """Inductor's code for the traced group, from the compile cache or compiled now (and stored there); its
    kernels bound without the GIL."""
    patches.apply(GIL_FREE_KERNELS)
    try:
        return _build_bound(gm, example, out_specs, inputs)
    finally:
        patches.undo(GIL_FREE_KERNELS)


def _build_bound(gm: Any, example: list, out_specs: tuple[Spec, ...], inputs: tuple[Spec, ...]) -> FusedKernel:
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
