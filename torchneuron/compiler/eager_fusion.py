"""Adaptive eager fusion: a run of queued elementwise and reduction ops on one stream becomes one host kernel.

The device's stream worker collects a run of queued ops whose names `fusable()` accepts (the op table's `fuse`
field; functional, in-place on `self`, or list ops taken apart into their per-tensor ops) into a group: `Node`s
whose arguments are group inputs (`Input`), results of earlier nodes (`Value`) or constants. `compile_group`
traces the nodes on fake tensors, decomposes them with the compiler's table and has Inductor's CPU code generator
compile them, each requested result stored straight into a preallocated buffer by a
final `copy_` (Inductor lowers it as a store of the fused loop; no extra copy). Compiled groups are cached in memory
by their whole signature (ops, constants with their types, input specs, requested outputs) and their generated code
on disk in the compile cache (compiler/cache.py), so the same group always runs the same code. A group that cannot
be compiled returns None (the ops then run unfused) and is counted in `stats()`.

Off under `TORCHNEURON_EAGER_FUSION=0` and under `torch.use_deterministic_algorithms(True)` (as AWS's adaptive
eager execution): `compile_group` then returns None. Importing this module is cheap: Inductor loads at the first
compile."""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from typing import Any, NamedTuple

import torch

from ..hardware import config
from ..runtime import patches
from ..runtime.optable import op_info
from .cache import Cache, digest
from .inductor import build, kernel_codegen, target


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
    """One functional op: `op` is its qualified name with overload ("aten::add.Tensor", "aten::relu"); `args` and
    `kwargs` hold Input, Value or constants (int, float, bool, None, torch.dtype, lists/tuples of these). `cast`:
    the dtype of the tensor an in-place op (`add_`, run as `add`) writes, which its result is rounded to."""

    op: str
    args: tuple
    kwargs: tuple[tuple[str, object], ...] = ()
    cast: torch.dtype | None = None


@dataclass
class Stats:
    """What fusion did in this process (the porting report reads it): distinct groups compiled, cache hits, fused
    kernel runs, groups that could not be compiled (run unfused) and why the last one failed, groups refused
    because fusion was off, and sightings of a signature not yet seen `after` times or still compiling (run
    unfused)."""

    compiled: int = 0
    cache_hits: int = 0
    runs: int = 0
    failures: int = 0
    disabled: int = 0
    cold: int = 0
    deferred: int = 0  # hot groups not handed to the compiler thread (its queue was full): submitted again later
    over_budget: int = 0  # hot groups never compiled: TORCHNEURON_FUSION_COMPILE_BUDGET was spent (they run unfused)
    compile_seconds: float = 0.0  # wall time spent compiling groups (from the compile cache on disk: little)
    last_failure: str | None = None


_STATS = Stats()
_CACHE: dict[tuple, FusedKernel | None] = {}
_SIGHTINGS: dict[tuple, int] = {}  # signatures seen but not compiled yet (compile_group's `after`)
_LOCK = threading.Lock()  # sightings and the cache: one compile decision at a time
ABI = 1  # bump when the meaning of a cached group changes


def install() -> None:
    """Hand the stream workers the fusion entry points (torchneuron's import does; this module stays light). Under
    TORCHNEURON_EAGER_FUSION=0 nothing is installed, so queued launches carry nothing and workers never take the
    GIL for fusion."""
    from .. import _C

    cfg = config.current_or_none()
    if cfg is not None and cfg.eager_fusion:
        _C._set_eager_fusion(fusable, lambda ops, verify=False: (plan_of if verify else run_queued)(
            [QueuedOp(*q) for q in ops]), min_elements=MIN_ELEMENTS, max_ops=MAX_OPS, max_list=MAX_LIST,
            after=AFTER)
        patches.apply(OPTIMIZER_STEP_RUNS)


_STEP_HOOKS: list[Any] = []  # the handles of OPTIMIZER_STEP_RUNS's two hooks


def _mark_run(begin: bool) -> Callable[..., None]:
    from .. import _C

    def hook(*_: Any) -> None:
        if not torch.compiler.is_compiling():  # a compiled step traces this to nothing: no graph break
            _C._mark_run(begin)

    return hook


def _optimizer_step_runs(done: patches.Applied) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _STEP_HOOKS[:] = [register_optimizer_step_pre_hook(_mark_run(True)),
                      register_optimizer_step_post_hook(_mark_run(False))]


def _remove_step_hooks() -> None:
    while _STEP_HOOKS:
        _STEP_HOOKS.pop().remove()


OPTIMIZER_STEP_RUNS = patches.declare(
    "optimizer-step-runs", "torch.optim global optimizer step pre/post hooks",
    "the stream worker takes an optimizer step's launches as one run whatever the host's timing (a loop that reads "
    "the loss first leaves the worker idle, and it took the step's first list op alone): the same groups fuse every "
    "step instead of new ones compiling for runs that rarely recur",
    "tests/test_eager_fusion.py::test_an_optimizer_step_reaches_the_worker_whole_whether_or_not_the_host_just_waited",
    _optimizer_step_runs, undo=_remove_step_hooks)


def stats() -> Stats:
    """This process's counts; `cold` includes the runs the stream workers ran unfused without building their group
    (counted in C++: a run not seen AFTER times yet, or whose kernel still compiles)."""
    from .. import _C

    return replace(_STATS, cold=_STATS.cold + _C._fusion_counts()["cold"])


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
    deterministic op (random draws keep the device generator's numbers) that is functional, in place on `self`
    (`add_`: the group computes `add` and stores it back), or a list op made of such per-tensor ops (`_foreach_*`,
    see `per_tensor`). An out= form writes memory its caller chose: never."""
    overload = _overload(op)
    if overload is None or not op_info(op).fuse or torch.Tag.nondeterministic_seeded in overload.tags:
        return False
    if overload._schema.name.startswith("aten::_foreach_"):
        return per_tensor(op) is not None
    return not overload._schema.is_mutable or _functional(overload) is not None


def _functional(overload: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The functional form of an in-place overload (`add_.Tensor` -> `add.Tensor`): only `self` is written."""
    schema = overload._schema
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if not schema.name.endswith("_") or len(written) != 1 or written[0] is not schema.arguments[0]:
        return None
    func = _overload(f"{schema.name[:-1]}.{schema.overload_name}" if schema.overload_name else schema.name[:-1])
    return func if func is not None and not func._schema.is_mutable else None


@dataclass(frozen=True)
class PerTensor:
    """How a list op runs as one per-tensor op for each tensor `i` (what ATen's CPU list kernels do): `op` is that
    op's qualified name, and `kinds` says for each of the list op's arguments whether it is sliced ("each": a
    list, element `i`), lifted ("lift": a number, element `i` of a list of numbers; it becomes a 0-dim kernel input
    rather than a constant compiled into the code, because optimizers pass values that change every step there:
    Adam's bias corrections and step sizes, a scheduled learning rate as SGD's `alpha`) or passed whole ("same").
    `kwargs`: the per-tensor op's name for an argument it takes by keyword only. `fold`: the per-tensor op takes
    the last (lifted) number as a Scalar multiplier of its argument 1 (add/sub's `alpha`, addcmul/addcdiv's
    `value`), so it multiplies that argument first: ATen computes `self + alpha * other` and
    `self + value * tensor1 op tensor2` in that order. `inplace`: the list op writes its `self` list."""

    op: str
    kinds: tuple[str, ...]
    kwargs: tuple[str | None, ...]
    fold: bool
    inplace: bool


@cache
def per_tensor(op: str) -> PerTensor | None:
    """The per-tensor form of a list op ("aten::_foreach_mul_.Scalar" -> `mul.Tensor` with the scalar lifted), or
    None when there is none (a list of scalars as a tensor, a Scalar `self`)."""
    overload = _overload(op)
    if overload is None:
        return None
    schema = overload._schema
    inplace = schema.is_mutable
    if inplace and _functional(overload) is None:
        return None
    base = schema.name.removeprefix("aten::_foreach_").removesuffix("_")
    args = schema.arguments
    if not args or str(args[0].type) != "List[Tensor]":
        return None
    kinds, types = [], []
    for a in args:
        t = str(a.type)
        kind = "each" if t.startswith("List[Tensor") else "lift" if t in ("number", "List[number]") else "same"
        if t.startswith("List[") and kind != "each" and t != "List[number]":
            return None
        kinds.append(kind)
        types.append("Tensor" if kind in ("each", "lift") else t)
    packet = getattr(torch.ops.aten, base, None)
    tries = [(types, False)] + ([(types[:-1], True)] if op_info(base).scalar_scales and kinds[-1] == "lift" else [])
    for want, fold in tries:
        for name in packet.overloads() if packet is not None else ():
            cargs = getattr(packet, name)._schema.arguments
            if getattr(packet, name)._schema.is_mutable or len(cargs) < len(want) or any(
                    str(c.type) != w for c, w in zip(cargs, want, strict=False)) or any(
                    not c.has_default_value() for c in cargs[len(want):]):
                continue
            kw = tuple(c.name if c.kwarg_only else None for c in cargs[:len(want)]) + ((None,) if fold else ())
            return PerTensor(f"aten::{base}" + ("" if name == "default" else f".{name}"), tuple(kinds), kw, fold,
                             inplace)
    return None


class FusedKernel:
    """A compiled group: `kernel(inputs, outs)` writes the requested results into `outs` (CPU tensors with
    `out_specs`), keeping no reference to either list. `source`: Inductor's generated code."""

    def __init__(self, call: Callable[[list], Any], out_specs: tuple[Spec, ...], source: str):
        self.call, self.out_specs, self.source = call, out_specs, source

    def __call__(self, inputs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        self.call([*inputs, *outs])  # Inductor's boxed call (it clears its list)
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


def _key(nodes: tuple[Node, ...], inputs: tuple[Spec, ...], outputs: tuple[Value, ...],
         mutations: tuple[tuple[int, Value], ...] = ()) -> tuple:
    """The group's signature, and the thread count Inductor's CPU code generator splits its loops for. Plain
    tuples (hashed in C): a group is looked up at every launch."""
    return (tuple((n.op, _typed(n.args), _typed(n.kwargs), n.cast) for n in nodes),
            tuple((tuple(s.sizes), tuple(s.strides), s.dtype) for s in inputs),
            tuple((v.node, v.index) for v in outputs), tuple((k, v.node, v.index) for k, v in mutations),
            torch.get_num_threads())


def compile_group(nodes: tuple[Node, ...], inputs: tuple[Spec, ...], outputs: tuple[Value, ...],
                  mutations: tuple[tuple[int, Value], ...] = (), *, after: int = 1,
                  background: bool = False) -> FusedKernel | None:
    """The fused kernel of a group (cached by signature), or None when fusion is off, the group cannot be
    compiled, the compile budget is spent (`_budget`), or its signature has been seen fewer than `after` times (each
    counted; the caller runs the ops unfused). `mutations`: (input, value) pairs, the kernel stores that value into
    that input's memory (what the group's in-place ops left there). `after` > 1 spends a compile (seconds) only on
    groups that recur, as a training step's do. `background`: the compile is handed to the fusion compiler thread
    and None is returned until the kernel is ready (a stream worker never waits for Inductor). Never raises."""
    if not enabled():
        _STATS.disabled += 1
        return None
    try:
        key = _key(nodes, inputs, outputs, mutations)
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
        if key in _BACKGROUND.pending:
            _STATS.cold += 1
            _wait_for(key)
            return None
        seen = _SIGHTINGS[key] = _SIGHTINGS.get(key, 0) + 1
        if seen < after:
            _STATS.cold += 1
            return None
        if _over_budget(key):
            _SIGHTINGS.pop(key)
            return None
        if background:
            _STATS.cold += 1
            if _BACKGROUND.submit(key, nodes, mutations):
                _SIGHTINGS.pop(key)
                _wait_for(key)
            else:
                _wait_for(None)
            return None
        dynamo = _dynamo_compile_lock()
        if not dynamo.acquire(blocking=False):  # torch.compile is compiling on another thread: not now
            _STATS.cold += 1
            return None
        try:
            _SIGHTINGS.pop(key)
            return _compile_key(key, nodes, mutations)
        finally:
            dynamo.release()


def _compile_key(key: tuple, nodes: tuple[Node, ...], mutations: tuple[tuple[int, Value], ...]) -> FusedKernel | None:
    """Compile a signature into _CACHE (None there when it cannot be compiled: it is not tried again)."""
    start = time.perf_counter()
    try:
        kernel = _compile(tuple(Spec(*s) for s in key[1]), tuple(Value(*v) for v in key[2]), nodes, mutations)
    except Exception as e:  # noqa: BLE001  (any failure means: run these ops unfused)
        return _failed(key, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    finally:
        _STATS.compile_seconds += time.perf_counter() - start
    _CACHE[key] = kernel
    _STATS.compiled += 1
    return kernel


_FX_TRACES: dict[int, int] = {}  # thread ident -> depth of torch.fx Tracer.trace calls running on it


def _fx_traces_here() -> bool:
    """Whether torch.fx's global tracing flag is this thread's: it traces, or no thread known to trace does (a
    trace that began before the patch below)."""
    return threading.get_ident() in _FX_TRACES or not _FX_TRACES


def _per_thread_fx_tracing(done: patches.Applied) -> None:
    import torch.fx._symbolic_trace as symbolic_trace

    original = symbolic_trace.Tracer.trace

    def trace(self: Any, root: Any, concrete_args: Any = None) -> Any:
        me = threading.get_ident()
        _FX_TRACES[me] = _FX_TRACES.get(me, 0) + 1
        try:
            return original(self, root, concrete_args)
        finally:
            _FX_TRACES[me] -= 1
            if not _FX_TRACES[me]:
                del _FX_TRACES[me]

    trace.__wrapped__ = original
    done.replace(symbolic_trace.Tracer, "trace", trace)
    done.replace(symbolic_trace, "_torchneuron_fx_traces_here", _fx_traces_here)

    # Bodies for torch.fx's own two readers of the flag; their names resolve in torch.fx._symbolic_trace.
    def is_fx_tracing() -> bool:
        return _is_fx_tracing_flag and _torchneuron_fx_traces_here()  # noqa: F821

    def is_fx_symbolic_tracing() -> bool:
        return _is_fx_tracing_flag and _torchneuron_fx_traces_here() and not torch.compiler.is_compiling()  # noqa: F821

    done.replace_code(symbolic_trace.is_fx_tracing, is_fx_tracing.__code__)
    done.replace_code(symbolic_trace.is_fx_symbolic_tracing, is_fx_symbolic_tracing.__code__)


PER_THREAD_FX_TRACING = patches.declare(
    "per-thread-fx-tracing", "torch.fx._symbolic_trace.Tracer.trace, is_fx_tracing, is_fx_symbolic_tracing (when "
    "the fusion compiler thread starts)", "torch.fx keeps one global 'tracing' flag: while the fusion compiler "
    "thread traces a group (make_fx, Inductor's pattern matcher), a torch.compile'd function called on the host "
    "thread would raise 'Detected that you are using FX to symbolically trace a dynamo-optimized function'; the flag "
    "now counts for the thread that traces",
    "tests/test_eager_fusion.py::test_a_trace_on_another_thread_is_not_this_threads", _per_thread_fx_tracing,
    when="first use")


class _Background:
    """The fusion compiler thread: compiles the groups stream workers found hot, one at a time, while they run the
    ops unfused (a worker that compiled itself stalled its stream for seconds, minutes for large groups). Bounded: at
    most MAX_PENDING signatures wait; a hot group that finds the queue full is counted (`stats().deferred`) and
    submitted again at a later sighting. Started at the first submit; a forked child starts its own."""

    def __init__(self) -> None:
        self.pending: set[tuple] = set()
        self.jobs: list[tuple] = []
        self.ready = threading.Condition(threading.Lock())
        self.compiling = threading.Lock()  # held around each compile; a fork waits for it (below)
        self.thread: threading.Thread | None = None

    def submit(self, key: tuple, nodes: tuple[Node, ...], mutations: tuple[tuple[int, Value], ...]) -> bool:
        with self.ready:
            if len(self.pending) >= MAX_PENDING:
                _STATS.deferred += 1
                return False
            self.pending.add(key)
            self.jobs.append((key, nodes, mutations))
            if self.thread is None:
                patches.apply(PER_THREAD_FX_TRACING)
                _wait_for_the_compile_at_fork()
                self.thread = threading.Thread(target=self._loop, name="torchneuron-fusion-compiler", daemon=True)
                self.thread.start()
            self.ready.notify_all()
        return True

    def _loop(self) -> None:
        while True:
            with self.ready:
                while not self.jobs:
                    self.ready.wait()
                key, nodes, mutations = self.jobs[0]
            with self.compiling, _dynamo_compile_lock():  # waits here, never on a stream worker
                if not _over_budget(key):  # the budget may have run out while it waited
                    _compile_key(key, nodes, mutations)
            with self.ready:
                self.jobs.pop(0)
                self.pending.discard(key)
                self.ready.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every submitted compile has finished (False: `timeout` seconds passed first)."""
        with self.ready:
            return self.ready.wait_for(lambda: not self.jobs, timeout)

    def forget(self) -> None:
        """In a forked child: the parent's thread does not exist there, and its jobs are the parent's."""
        self.__init__()

    def stop(self) -> None:
        """At exit: wait (TORCHNEURON_EXIT_TIMEOUT at most) for the compile in progress and start no other. A daemon
        thread still inside Inductor's C++ code when the interpreter finalizes is unwound by CPython through frames
        that may not be unwound, and the process aborts ("terminate called without an active exception")."""
        if self.thread is not None:
            cfg = config.current_or_none()
            self.compiling.acquire(timeout=cfg.exit_timeout if cfg is not None else 60.0)


_BACKGROUND = _Background()
atexit.register(_BACKGROUND.stop)
FORK_WAIT = 10.0  # seconds a fork waits for the compile in progress (then the child is repaired instead)
_FORK_REGISTERED = [False]
_FORKING = threading.local()  # .waited: whether this thread's fork holds the compile lock (forks of two threads)
_TIMED_OUT_ON: list[Any] = [None]  # the compile a fork gave up waiting for: later forks do not wait for it again


def _before_fork() -> None:
    job = next(iter(_BACKGROUND.jobs), (None,))[0]  # the compile in progress (the compiler thread pops it after)
    waited = _BACKGROUND.compiling.acquire(timeout=0 if job is not None and job == _TIMED_OUT_ON[0] else FORK_WAIT)
    if not waited:
        _TIMED_OUT_ON[0] = job
    _FORKING.waited = waited


def _after_fork_in_parent() -> None:
    if getattr(_FORKING, "waited", False):
        _BACKGROUND.compiling.release()


def _after_fork_in_child() -> None:
    """The parent's compiler thread does not exist here: its jobs are forgotten, and when the fork did not wait for
    its compile, what that thread may hold is put right: Dynamo's compile lock is replaced (the child's first
    torch.compile would otherwise wait for it forever) and the Inductor settings a fusion compile patches are
    restored."""
    _BACKGROUND.forget()
    if getattr(_FORKING, "waited", True):
        return
    if "torch._dynamo.convert_frame" in sys.modules:
        sys.modules["torch._dynamo.convert_frame"].compile_lock = threading.RLock()
    if "torch._inductor.config" in sys.modules:
        for name, value in _SETTINGS_BEFORE.items():
            setattr(sys.modules["torch._inductor.config"], name, value)


def _wait_for_the_compile_at_fork() -> None:
    """A fork waits (FORK_WAIT at most) for the compile in progress, as it waits for the streams, so the child is
    not left with the compiler thread's locks. Registered when the compiler thread first starts, after filelock's
    own fork hooks (Inductor takes file locks while compiling): hooks run last-registered first, so this wait ends
    before filelock closes its gate; the other way round the compile blocked at the gate while the fork waited for
    it, and a DataLoader's fork hung for good."""
    if _FORK_REGISTERED[0]:
        return
    _FORK_REGISTERED[0] = True
    try:
        import filelock  # noqa: F401  (registers its fork hooks now, before ours)
    except ImportError:
        pass
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


def wait_compiles(timeout: float | None = None) -> bool:
    """Wait for the fusion compiles stream workers handed to the compiler thread (tests, benchmarks: make the hot
    groups' kernels ready before measuring). False when `timeout` seconds passed first."""
    return _BACKGROUND.wait(timeout)


AFTER = 3  # sightings of a run (the stream worker counts them) before its group is built and compiled (a step recurs)
# Inductor's C++ build time grows faster than the kernel: measured, two list ops over 8 tensors of 128x128 compile in
# 4 s, over 16 in 7 s, over 32 in 65 s. So no kernel holds more than MAX_NODES nodes: a longer run of list ops is
# split by tensor (`_split`) into kernels of at most COLUMNS tensors' nodes each.
MAX_NODES = 64
COLUMNS = 8  # a split kernel's tensors (of one list position each)
MAX_LIST = 1024  # tensors of a list op that joins a group (its group is built in Python once the run is hot)
MIN_ELEMENTS = 1 << 18  # a smaller op is not worth a fused kernel: the hand-over to Python costs tens of microseconds
MAX_OPS = 16  # queued ops a stream worker hands over as one run
MAX_PENDING = 16  # signatures waiting for the compiler thread


class QueuedOp(NamedTuple):
    """One queued kernel as the stream worker hands it over: its qualified name with overload, its arguments
    (CPU views of device memory, Python numbers for wrapped scalars, constants) and the CPU views of the results
    its launch handed out (none for an in-place op: it writes its `self`)."""

    op: str
    args: list
    outs: list[torch.Tensor]


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of `t`'s storage: two tensors over overlapping storage are treated as one memory."""
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


class _Spans:
    """Memory extents (start, end), numbered in the order added, found by overlap in time linear in what they share
    a 64 KiB page with: a group over a model's hundreds of parameters checks each tensor against every other."""

    PAGE = 16  # bits

    def __init__(self) -> None:
        self.items: list[tuple[int, int]] = []
        self.pages: dict[int, list[int]] = {}

    def _pages(self, a: tuple[int, int]) -> range:
        return range(a[0] >> self.PAGE, ((a[1] - 1) >> self.PAGE) + 1) if a[0] < a[1] else range(0)

    def add(self, a: tuple[int, int]) -> None:
        for p in self._pages(a):
            self.pages.setdefault(p, []).append(len(self.items))
        self.items.append(a)

    def hits(self, a: tuple[int, int]) -> set[int]:
        """The numbers of the extents overlapping `a` (none for an empty one)."""
        return {i for p in self._pages(a) for i in self.pages.get(p, ())
                if a[0] < self.items[i][1] and self.items[i][0] < a[1]}

    def truncate(self, n: int) -> None:
        """Forget the extents numbered `n` and after."""
        while len(self.items) > n:
            for p in self._pages(self.items[-1]):
                self.pages[p].pop()
            self.items.pop()


class Plan(NamedTuple):
    """How a fused run maps onto the queued ops' arguments, for the stream worker to replay it without building
    the group again (csrc/fusion.cpp keeps it under the run's signature: ops, tensor addresses and layouts).
    Leaves number the tensors and numbers of the queued ops' arguments and then results, depth first, in order.
    `args`: the leaf of each kernel argument (inputs, then outputs); `lifts`: per input, the dtype of the 0-dim
    tensor a lifted scalar leaf becomes (None: a tensor leaf); `baked`: number leaves compiled into the code,
    with their values (a replay with another value is no replay)."""

    kernel: FusedKernel
    ops: int
    args: tuple[int, ...]
    lifts: tuple[torch.dtype | None, ...]
    baked: tuple[tuple[int, object], ...]


def run_queued(ops: list[QueuedOp]) -> tuple:
    """The stream worker's entry (csrc/fusion.cpp), for a run whose signature it has seen AFTER times (it counts
    sightings itself and runs the others unfused: building a group costs milliseconds): fuse the longest leading
    run of `ops` into one kernel and run it. Returns how many ops it ran and its Plan; 0 and None when none fused
    (the worker runs the first op alone and offers the rest again); 0, the group's op count and a `_Waiting` when
    its kernel is compiling (the worker runs those ops one by one, offers none of them again, and asks again once
    the `_Waiting` returns True); 0 and the op count alone when it never will be (failed, over the budget); when the
    fused kernel itself raised, minus the ops it covered and the error's text (they fail: none runs again). Never
    raises.

    A result whose memory a later op of the run was handed (Python freed it, the allocator gave its block again) is
    read only inside the run (every reader was launched before the free), so it lives in registers and is not
    stored; every other result is, and so is every tensor an in-place op wrote. A run ends before an op that reads
    a view of an earlier result or of a written tensor (only whole values flow through a group), whose results
    share memory with the run's inputs or other results, or that writes a tensor overlapping another input."""
    try:
        return _run_queued(ops)
    except _KernelRaised as e:  # it may have stored results: its ops fail with its error (never run twice)
        return -e.ops, f"{type(e.__cause__).__name__}: {e.__cause__}"
    except Exception as e:  # noqa: BLE001  (any failure means: run these ops unfused)
        _failed(None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        return 0, None


@dataclass(frozen=True)
class _Result:
    value: Value
    out: torch.Tensor
    span: tuple[int, int]
    leaf: int
    stored: bool = True


class _Refused(Exception):
    """The op cannot join the group (the group stays as it was)."""


class _KernelRaised(Exception):
    """The fused kernel raised while running `ops` ops (its error is the cause)."""

    def __init__(self, ops: int) -> None:
        super().__init__(ops)
        self.ops = ops


def _integral(args: list) -> bool:
    """Any tensor (or list element) among `args` of an integer or bool dtype."""
    return any(_integral(a) if isinstance(a, (list, tuple)) else
               isinstance(a, torch.Tensor) and not (a.is_floating_point() or a.is_complex()) for a in args)


def _is_number(a: Any) -> bool:
    return type(a) is float or type(a) is int or type(a) is bool


class _Group:
    """A run of queued ops being turned into Nodes: group inputs are deduplicated by (address, sizes, strides,
    dtype); an argument equal to an earlier op's result, or to a tensor an earlier op wrote, becomes its Value."""

    def __init__(self, split: bool = True) -> None:
        self.nodes: list[Node] = []
        self.inputs: list[torch.Tensor] = []
        self.input_leaf: list[int] = []
        self.lifts: list[torch.dtype | None] = []
        self.input_ids: dict[tuple, int] = {}
        self.in_spans = _Spans()  # per input, its memory ((0, 0) for a lifted scalar)
        self.produced: dict[tuple, Value] = {}
        self.results: list[_Result] = []
        self.result_spans = _Spans()  # per result, its memory
        self.newest: dict[tuple, int] = {}  # a result's (address, layout) -> the newest result over it
        self.mutations: dict[int, Value] = {}  # input -> the value its memory ends with
        self.written = _Spans()  # extents of the inputs written
        self.baked: list[tuple[int, object]] = []
        self.leaves = 0
        self.ops = 0
        self.split = split  # may the group grow past MAX_NODES, to be split by list position
        self.column: list[int] = []  # per node: the list position of the list op it came from (-1: not one)
        self.per_column: dict[int, int] = {}  # nodes of each list position
        self.whole = False  # a node outside any list op: the group is one kernel

    def state(self) -> tuple:
        return (len(self.nodes), len(self.inputs), dict(self.input_ids), dict(self.produced), list(self.results),
                dict(self.newest), dict(self.mutations), len(self.written.items), len(self.baked), self.leaves,
                dict(self.per_column), self.whole)

    def restore(self, st: tuple) -> None:
        n, i, self.input_ids, self.produced, self.results, self.newest, self.mutations, w, bk, self.leaves, \
            self.per_column, self.whole = st
        del self.nodes[n:], self.column[n:], self.inputs[i:], self.input_leaf[i:], self.lifts[i:], self.baked[bk:]
        self.in_spans.truncate(i)
        self.result_spans.truncate(len(self.results))
        self.written.truncate(w)

    def too_big(self) -> bool:
        """Over MAX_NODES in one kernel: the whole group, or (when it may be split) one list position's nodes."""
        return len(self.nodes) > MAX_NODES and (
            not self.split or self.whole or max(self.per_column.values()) > MAX_NODES)

    @staticmethod
    def meta(t: torch.Tensor) -> tuple:
        return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)

    def add(self, q: QueuedOp, overload: torch._ops.OpOverload) -> bool:
        """Append `q` as the next node(s), or leave the group as it was and say no."""
        st = self.state()
        try:
            if op_info(q.op).int_errors and _integral(q.args):
                raise _Refused  # may raise on a value: run unfused, so an error leaves memory as the op alone would
            (self._add_list if overload._schema.name.startswith("aten::_foreach_") else self._add_one)(q, overload)
            if self.too_big():
                raise _Refused
        except _Refused:
            self.restore(st)
            return False
        self.ops += 1
        return True

    def _leaves(self, a: Any) -> Any:
        """`a` with each tensor and number replaced by (its leaf number, itself), lists kept."""
        if isinstance(a, (list, tuple)):
            return [self._leaves(x) for x in a]
        if isinstance(a, torch.Tensor) or _is_number(a):
            self.leaves += 1
            return (self.leaves - 1, a)
        return a

    def _arg(self, a: Any) -> Any:
        """An argument (from `_leaves`) as the node sees it: Input, Value or constant."""
        if isinstance(a, list):
            return [self._arg(x) for x in a]
        if not isinstance(a, tuple):
            return a
        leaf, v = a
        if not isinstance(v, torch.Tensor):
            self.baked.append((leaf, v))
            return v
        m = self.meta(v)
        if m in self.produced:
            return self.produced[m]
        span = _extent(v)
        if self.result_spans.hits(span) or self.written.hits(span):
            raise _Refused  # a view of an earlier result or of a written tensor
        if m not in self.input_ids:
            self._input(v, leaf, None, span)
        return Input(self.input_ids[m])

    def _input(self, t: torch.Tensor, leaf: int, lift: torch.dtype | None, span: tuple[int, int]) -> Input:
        k = len(self.inputs)
        if lift is None:
            self.input_ids[self.meta(t)] = k
        self.in_spans.add(span)
        self.inputs.append(t)
        self.input_leaf.append(leaf)
        self.lifts.append(lift)
        return Input(k)

    def _lift(self, a: tuple, like: torch.Tensor) -> Input:
        """A list op's scalar as a 0-dim input of the dtype ATen computes `like`'s values in."""
        leaf, v = a
        if not like.is_floating_point() or not _is_number(v):
            raise _Refused  # an integer list's scalar promotes as a wrapped number: baked ops only
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        return self._input(torch.tensor(v, dtype=dtype), leaf, dtype, (0, 0))

    def _node(self, op: str, args: list, kwargs: list[tuple[str, Any]], cast: torch.dtype | None = None,
              column: int = -1) -> int:
        self.nodes.append(Node(op, tuple(args), tuple(kwargs), cast))
        self.column.append(column)
        self.whole |= column < 0
        if column >= 0:
            self.per_column[column] = self.per_column.get(column, 0) + 1
        return len(self.nodes) - 1

    def _result(self, out: tuple, value: Value, taken: _Spans) -> None:
        """`out` (leaf, the CPU view of a launched result) holds `value`; `taken`: the op's earlier results."""
        leaf, o = out
        span = _extent(o)
        if self.in_spans.hits(span) or self.written.hits(span) or taken.hits(span):
            raise _Refused
        taken.add(span)
        m = self.meta(o)
        self.produced[m] = value
        self.newest[m] = len(self.results)
        self.results.append(_Result(value, o, span, leaf))
        self.result_spans.add(span)

    def _write(self, t: torch.Tensor, value: Value) -> None:
        """An in-place op left `value` in `t`'s memory."""
        m = self.meta(t)
        j = self.newest.get(m)
        if j is not None:  # the newest result over that memory
            self.results[j] = replace(self.results[j], value=value)
        else:
            k = self.input_ids.get(m)
            span = _extent(t)
            if k is None or self.in_spans.hits(span) - {k}:
                raise _Refused  # memory another input reads too
            self.mutations[k] = value
            self.written.add(span)
        self.produced[m] = value

    def _stores_freed(self, spans: list[tuple[int, int]]) -> None:
        for j in sorted({j for a in spans for j in self.result_spans.hits(a)}):
            if self.results[j].stored:  # its block was handed out again
                self.results[j] = replace(self.results[j], stored=False)

    def _add_one(self, q: QueuedOp, overload: torch._ops.OpOverload) -> None:
        func = _functional(overload) if overload._schema.is_mutable else overload
        schema = overload._schema.arguments
        leaves = [self._leaves(v) for v in q.args]
        outs = [self._leaves(o) for o in q.outs]
        args = [self._arg(v) for a, v in zip(schema, leaves, strict=False) if not a.kwarg_only]
        kwargs = [(a.name, self._arg(v)) for a, v in zip(schema, leaves, strict=False) if a.kwarg_only]
        if func is overload:
            spans = _Spans()
            self._stores_freed([_extent(o) for _, o in outs])
            n = self._node(q.op, args, kwargs)
            for j, o in enumerate(outs):
                self._result(o, Value(n, j), spans)
        else:
            name = func._schema.name + (f".{func._schema.overload_name}" if func._schema.overload_name else "")
            self._write(q.args[0], Value(self._node(name, args, kwargs, q.args[0].dtype)))

    def _add_list(self, q: QueuedOp, overload: torch._ops.OpOverload) -> None:
        how = per_tensor(q.op)
        if how is None:
            raise _Refused
        leaves = [self._leaves(v) for v in q.args]
        outs = [self._leaves(o) for o in q.outs]
        selfs = leaves[0]
        if len(selfs) > MAX_LIST:
            raise _Refused
        if how.inplace:
            outs = []
        elif len(outs) != len(selfs):
            raise _Refused
        self._stores_freed([_extent(o) for _, o in outs])
        spans = _Spans()
        for i, (_, t) in enumerate(selfs):
            args: list = []
            kwargs: list = []
            for kind, name, v in zip(how.kinds, how.kwargs, leaves, strict=True):
                if kind == "lift":
                    v = self._lift(v[i] if isinstance(v, list) else v, t)
                else:
                    if kind == "each":
                        if len(v) != len(selfs):
                            raise _Refused
                        v = v[i]
                    v = self._arg(v)
                (kwargs.append((name, v)) if name else args.append(v))
            if how.fold:  # value * tensor1 first, as ATen's kernel does
                args[1] = Value(self._node("aten::mul.Tensor", [args[1], args.pop()], [], column=i))
            n = self._node(how.op, args, kwargs, t.dtype if how.inplace else None, column=i)
            if how.inplace:
                self._write(t, Value(n))
            else:
                self._result(outs[i], Value(n), spans)


def plan_of(ops: list[QueuedOp]) -> tuple[int, Plan | None]:
    """Replay verification (tests: `_C._set_verify_replay`): the plan the group builder makes for `ops` now, without
    running it, for the worker to compare with the plan it just replayed under the run's C++ signature. Never
    raises."""
    try:
        built = _fused_group(ops)
    except Exception:  # noqa: BLE001
        return 0, None
    if built is None or built[1] is None:
        return 0, None
    group, kernel, wanted = built
    return group.ops, _plan(group, kernel, wanted)


def _plan(group: _Group, kernel: FusedKernel, wanted: list[_Result]) -> Plan:
    return Plan(kernel, group.ops, (*group.input_leaf, *(r.leaf for r in wanted)), tuple(group.lifts),
                tuple(group.baked))


def _fused_group(ops: list[QueuedOp]) -> tuple[_Group, FusedKernel | SplitKernel | None, list[_Result]] | None:
    """The group of the leading ops that fuse (None: under two ops), and its compiled kernel (None: not yet). A
    group over MAX_NODES nodes (list ops over many tensors) runs as kernels by list position; when its positions
    depend on each other it is built again, stopping at MAX_NODES."""
    group = _group_of(ops, split=True)
    if group.ops < 2:
        return None
    wanted = [r for r in group.results if r.stored]
    if len(group.nodes) > MAX_NODES:
        parts = _split(group, wanted)
        if parts is not None:
            return group, _split_kernel(group, parts, wanted), wanted
        group = _group_of(ops, split=False)
        if group.ops < 2:
            return None
        wanted = [r for r in group.results if r.stored]
    kernel = compile_group(tuple(group.nodes), _specs(group.inputs), tuple(r.value for r in wanted),
                           tuple(sorted(group.mutations.items())), background=True)
    return group, kernel, wanted


def _group_of(ops: list[QueuedOp], split: bool) -> _Group:
    group = _Group(split)
    for q in ops:
        overload = _overload(q.op)
        if overload is None or not fusable(q.op) or not group.add(q, overload):
            break
    return group


def _specs(tensors: list[torch.Tensor]) -> tuple[Spec, ...]:
    return tuple(Spec(tuple(t.shape), t.stride(), t.dtype) for t in tensors)


class _Part(NamedTuple):
    """Some list positions of a split group as a group of their own: `nodes` renumbered, the group inputs it reads
    (`inputs`, in its Input order), the group's stored results it writes (`outputs`, indices into the stored ones,
    with their `values` in its nodes) and its `mutations` (its input, its value)."""

    nodes: tuple[Node, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    values: tuple[Value, ...]
    mutations: tuple[tuple[int, Value], ...]


def _refs(a: Any) -> list:
    """The Inputs and Values among a node's arguments."""
    if isinstance(a, (list, tuple)):
        return [r for x in a for r in _refs(x)]
    return [a] if isinstance(a, (Input, Value)) else []


def _part(group: _Group, nodes: list[int], outputs_of: dict[int, list[tuple[int, int]]],
          mutations_of: dict[int, list[tuple[int, int]]]) -> _Part:
    """The nodes `nodes` (ascending, closed under Values) of `group` renumbered as a group of their own.
    `outputs_of`/`mutations_of`: per node, the (stored result, its index) and (input, its index) it leaves."""
    local_node = {n: j for j, n in enumerate(nodes)}
    local_input: dict[int, int] = {}

    def rename(a: Any) -> Any:
        if isinstance(a, Input):
            return Input(local_input.setdefault(a.k, len(local_input)))
        if isinstance(a, Value):
            return Value(local_node[a.node], a.index)
        if isinstance(a, (list, tuple)):
            return type(a)(rename(x) for x in a)
        return a

    renamed = tuple(replace(group.nodes[n], args=rename(group.nodes[n].args),
                            kwargs=tuple((k, rename(v)) for k, v in group.nodes[n].kwargs)) for n in nodes)
    outputs = sorted((i, Value(local_node[n], j)) for n in nodes for i, j in outputs_of.get(n, ()))
    mutations = tuple(sorted((local_input[k], Value(local_node[n], j))
                             for n in nodes for k, j in mutations_of.get(n, ())))
    return _Part(renamed, tuple(local_input), tuple(i for i, _ in outputs), tuple(v for _, v in outputs), mutations)


def _split(group: _Group, wanted: list[_Result]) -> list[_Part] | None:
    """`group`'s list positions as parts of at most COLUMNS positions each, positions of one shape together (one
    kernel serves every part of that shape), or None when a position cannot run alone: every node must come from
    a list op, read only its own position's values, and an input one position writes must be read by no other
    (the parts run one after another)."""
    if group.whole:
        return None
    readers: dict[int, set[int]] = {}
    for node, column in zip(group.nodes, group.column, strict=True):
        for r in _refs((node.args, node.kwargs)):
            if isinstance(r, Input):
                readers.setdefault(r.k, set()).add(column)
            elif group.column[r.node] != column:
                return None
    if any(readers.get(k, set()) - {group.column[v.node]} for k, v in group.mutations.items()):
        return None
    outputs_of: dict[int, list[tuple[int, int]]] = {}
    for i, r in enumerate(wanted):
        outputs_of.setdefault(r.value.node, []).append((i, r.value.index))
    mutations_of: dict[int, list[tuple[int, int]]] = {}
    for k, v in group.mutations.items():
        mutations_of.setdefault(v.node, []).append((k, v.index))
    by_column: dict[int, list[int]] = {}
    for n, column in enumerate(group.column):
        by_column.setdefault(column, []).append(n)
    shapes: dict[tuple, list[int]] = {}  # a position's own group (its input specs) -> positions
    for column, nodes in by_column.items():
        p = _part(group, nodes, outputs_of, mutations_of)
        shapes.setdefault(_key(p.nodes, _specs([group.inputs[k] for k in p.inputs]), p.values, p.mutations),
                          []).append(column)
    return [_part(group, sorted(n for c in columns[i:i + COLUMNS] for n in by_column[c]), outputs_of, mutations_of)
            for columns in shapes.values() for i in range(0, len(columns), COLUMNS)]


class SplitKernel:
    """A split group's kernels, run one after another: `kernel(inputs, outs)` as a FusedKernel's."""

    def __init__(self, parts: tuple[tuple[FusedKernel, tuple[int, ...], tuple[int, ...]], ...],
                 out_specs: tuple[Spec, ...]):
        self.parts, self.out_specs = parts, out_specs

    def __call__(self, inputs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        for kernel, ins, written in self.parts:
            kernel.call([*(inputs[k] for k in ins), *(outs[j] for j in written)])
        _STATS.runs += 1


_SPLITS: dict[tuple, SplitKernel] = {}  # one object per arrangement of kernels: the worker's plans hold it


def _split_kernel(group: _Group, parts: list[_Part], wanted: list[_Result]) -> SplitKernel | None:
    """The parts' kernels (None until every one is compiled; each compiles off the stream once it recurs)."""
    kernels = []
    compiled: dict[tuple, FusedKernel | None] = {}  # each shape sighted once per build
    for p in parts:
        specs = _specs([group.inputs[i] for i in p.inputs])
        key = _key(p.nodes, specs, p.values, p.mutations)
        if key not in compiled:
            compiled[key] = compile_group(p.nodes, specs, p.values, p.mutations, background=True)
        kernels.append((compiled[key], p.inputs, p.outputs))
    if any(k is None for k, _, _ in kernels):
        return None
    key = tuple((id(k), i, o) for k, i, o in kernels)
    if key not in _SPLITS:
        specs: list[Spec | None] = [None] * len(wanted)
        for k, _, outputs in kernels:
            for j, spec in zip(outputs, k.out_specs, strict=True):
                specs[j] = spec
        _SPLITS[key] = SplitKernel(tuple(kernels), tuple(specs))
    return _SPLITS[key]


class _Waiting:
    """A hot group's compiles in flight (their keys), and whether one found the compiler's queue full: the stream
    worker asks the group builder again only once this returns True (their kernels are ready, or the queue has
    room), not at every sighting."""

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.deferred = False

    def __call__(self) -> bool:
        return not any(k in _BACKGROUND.pending for k in self.keys) and (
            not self.deferred or len(_BACKGROUND.pending) < MAX_PENDING)


_WAITING = threading.local()  # the _Waiting of the group being built on this thread


def _wait_for(key: tuple | None) -> None:
    """The group being built waits for `key`'s compile (None: for room in the compiler's queue)."""
    w = getattr(_WAITING, "group", None)
    if w is None:
        return
    if key is None:
        w.deferred = True
    else:
        w.keys.append(key)


def _run_queued(ops: list[QueuedOp]) -> tuple:
    if not enabled():
        _STATS.disabled += 1
        return 0, None
    waiting = _WAITING.group = _Waiting()
    try:
        built = _fused_group(ops)
    finally:
        _WAITING.group = None
    if built is None:
        return 0, None
    group, kernel, wanted = built
    if kernel is None:  # compiling (ask again when `waiting` says so), or never (failed, over the budget)
        return (0, group.ops, waiting) if waiting.keys or waiting.deferred else (0, group.ops)
    outs = [r.out for r in wanted]
    if any(s != Spec(tuple(o.shape), o.stride(), o.dtype) for s, o in zip(kernel.out_specs, outs, strict=True)):
        return _failed(None, "the fused results' layout differs from the launched ones") or (0, None)
    try:
        kernel(group.inputs, outs)
    except Exception as e:
        raise _KernelRaised(group.ops) from e
    return group.ops, _plan(group, kernel, wanted)


def _budget() -> float:
    """Seconds of fusion compiling this process may spend (TORCHNEURON_FUSION_COMPILE_BUDGET): a model with many
    distinct groups compiles one kernel each (seconds apiece, on a core the stream worker and the host share), so
    past the budget new groups stay unfused (counted: `stats().over_budget`, the porting report) instead of
    compiling without end. Kernels already compiled keep running."""
    cfg = config.current_or_none()
    return cfg.fusion_compile_budget if cfg is not None else config.Config.fusion_compile_budget


def _over_budget(key: tuple) -> bool:
    """Whether the budget is spent; if so the signature is never compiled in this process (counted, remembered:
    its ops run unfused from now on)."""
    if _STATS.compile_seconds < _budget():
        return False
    _STATS.over_budget += 1
    _CACHE[key] = None
    return True


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
        r = tuple(r) if isinstance(r, (tuple, list)) else (r,)
        if node.cast is not None:
            r = tuple(x if x.dtype == node.cast else x.to(node.cast) for x in r)
        results.append(r)
    return results


def _compile(inputs: tuple[Spec, ...], outputs: tuple[Value, ...], nodes: tuple[Node, ...],
             mutations: tuple[tuple[int, Value], ...] = ()) -> FusedKernel:
    from torch._inductor import config as inductor_config

    # Eager rounds every op's bfloat16/float16 result: the trace marks each op's result, Inductor rounds it. No size
    # asserts: a kernel is only called on the layouts its key (or the replayed plan's signature) holds, and checking
    # each argument again in Python cost more than the loop of a small list op's kernel (AdamW over an HF GPT-2: 23
    # kernels, 1.8 ms -> 1.0 ms).
    _SETTINGS_BEFORE.update({name: getattr(inductor_config, name) for name in _COMPILE_SETTINGS})
    with inductor_config.patch(**_COMPILE_SETTINGS):
        return _build(*_trace(inputs, outputs, nodes, mutations), inputs)


_COMPILE_SETTINGS = {"emulate_precision_casts": True, "size_asserts": False}  # patched while a fusion compiles
_SETTINGS_BEFORE: dict[str, Any] = {}  # their values outside it (a child forked mid-compile gets them back)


def _trace(inputs: tuple[Spec, ...], outputs: tuple[Value, ...], nodes: tuple[Node, ...],
           mutations: tuple[tuple[int, Value], ...] = ()) -> tuple:
    """The group as an aten graph over (inputs..., out buffers...) ending in a copy_ into each buffer and into each
    input an in-place op wrote (Inductor orders the reads of that input's old values before the store), the fake
    example arguments, and the specs of the results (what the unfused ops would return)."""
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from .passes import decompositions

    if not nodes or not (outputs or mutations):
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
        for k, v in mutations:
            torch.ops.aten.copy_.default(args[k], results[v.node][v.index])
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
    """Inductor's code for the traced group, from the compile cache or compiled now (and stored there); its
    kernels bound without the GIL."""
    with kernel_codegen():
        return _build_bound(gm, example, out_specs, inputs)


def _build_bound(gm: Any, example: list, out_specs: tuple[Spec, ...], inputs: tuple[Spec, ...]) -> FusedKernel:
    from torch._inductor.codecache import PyCodeCache


    disk = Cache()
    key = digest({"eager_fusion": ABI, "graph": gm.code, "inputs": repr(inputs), "outputs": repr(out_specs),
                  "target": target()})
    with disk.inductor_dir():
        entry = disk.load(key)
        if entry is not None:
            return FusedKernel(PyCodeCache.load(entry["source"]).call, out_specs, entry["source"])
        call, _, source = build(gm, example, {"is_inference": True})
        if call is None:  # no constants held by the module: it reloads from its source text
            call = PyCodeCache.load(source).call
            disk.store(key, {"graph": gm.code, "source": source, "output_strides": [s.strides for s in out_specs]})
    return FusedKernel(call, out_specs, source)
