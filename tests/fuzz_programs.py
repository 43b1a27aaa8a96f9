"""Differential fuzzing of the asynchronous device (issue 26): seeded random programs run on `neuron` and on the CPU.

A program is a list of statements (Python source over named tensors t0, t1, ...; every name is bound once) made
by `generate(seed)`: tensors of every dtype the device handles (float32, bfloat16, int32, int64, bool) and shapes
up to 512x512 (>= 2**18 elements, so queued ops and eager fusion really happen), functional, reduction and matmul
ops, in-place ops, views and writes through them, overlapping writes, `copy_` between shapes, host round trips,
side streams and events, `slow()` (queued matmuls that later work queues behind), loops that recur so that eager
fusion compiles and replays groups, and failing statements. The generator runs each statement on the CPU as it
makes it, so it knows every shape, dtype and whether the statement raised (a name a failed statement would have
bound is never used again). `run` executes a program on one device in a mode; every statement runs in try/except
and its trace records the exception type (or None) and the values it read. `compare` applies the rules below;
`minimize` shrinks a mismatching program (delta debugging on statements) and `repro` prints it as runnable Python.

Comparison rules (the device's error semantics; CPU is the reference):

1. Host-checkable errors (shapes, broadcasting, overlap, dtypes, devices, a CPU tensor where a device one is
   needed, and every error of a statement not marked data-dependent) raise on neuron at the same statement with
   the CPU's exception type.
2. Data-dependent device-side errors (an out-of-range index in index_select/gather/embedding/index/index_add_...,
   integer division by zero inside a kernel) may be deferred: on neuron they raise at that statement, or at a later
   statement that is a sync point or host read (`.cpu()`, `.item()`, `.tolist()`, `torch.tensor(list)`,
   `synchronize`, event/stream synchronize), or at a later statement that depends on the failed work (reads a
   tainted tensor, below), with the CPU's exception type. Every deferred error surfaces by the end of the program
   (which ends with `torch.neuron.synchronize()` and a read of every live tensor). An unrelated sync point or read
   may raise a pending error once (the first sync after the failure, CUDA-style); a surfacing reports every error
   pending at that time, except that each failure is raised once: one that the surfacing did not name (another
   stream's failure, carried by an event wait to a stream that had failed itself) may still surface at a later sync
   point or dependent statement; when it does, the failures pending behind it on that stream may surface later too
   (a stream keeps every failure the user has not seen, oldest first, and a sync point raises one of them).
3. Never a garbage value: every value neuron returns from a read equals the CPU's value for that read (integers and
   bools exactly; floats exactly under TORCHNEURON_EAGER_FUSION=0, else within 1e-5 (float32) or 2**-7 (bfloat16)
   relative, absolute errors relative to the tensor's largest value: sums in another order). A tensor is tainted
   when a failing data-dependent statement wrote it (the CPU may have written it partially; on neuron the launch
   may have been skipped), when a statement on neuron raised a deferred error in its place, or when a successful
   statement read a tainted tensor; taint is by storage, so views share it. A read of a tainted tensor may raise
   a deferred error's type (any time: precise poisoning) or must equal the CPU's value; nothing else (a failing
   statement that raised at the call on both devices leaves what it wrote unspecified: not compared). Reads of
   untainted tensors return the CPU's values. Once a program's tensors are freed, none of its memory stays poisoned
   (the next tensors the allocator puts there are computed as any).
4. Under launch blocking (TORCHNEURON_LAUNCH_BLOCKING=1, `torchneuron._C._set_launch_blocking(True)`) nothing is
   deferred: every error raises at exactly the CPU's statement.

A statement that raised on the CPU binds no name on neuron either (the interpreter drops the names neuron bound),
so that both runs continue over the same names; a name neuron could not bind because it raised a permitted
deferred error is "lost", and a later statement using it may raise NameError there.

Modes: "default", "queue" (`torchneuron._C._set_queue_everything(True)`: small ops queue too), "blocking"
(launch blocking). Streams and events on the CPU run are no-op stand-ins (`CpuStreams`), and the "other device"
of a mixed-device statement is `meta` (on neuron it is the CPU).
"""
from __future__ import annotations

import gc
import math
import random
import re
import textwrap
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

import torchneuron

MODES = ("default", "queue", "blocking")

# ----------------------------------------------------------------------------------------------- the prelude

PRELUDE = '''\
import torch
import torch.nn.functional as F


def mk(shape, dtype, seed, kind):
    """A tensor made on the CPU from a seed (same values on every device), then moved to `dev`."""
    g = torch.Generator().manual_seed(seed)
    if kind == "int":  # small integers: exact under any order of additions
        t = torch.randint(-4, 5, shape, generator=g)
    elif kind == "pos":
        t = torch.randint(1, 5, shape, generator=g)
    elif kind == "bool":
        t = torch.randint(0, 2, shape, generator=g).bool()
    else:
        t = torch.randn(shape, generator=g)
    return t.to(dtype).to(dev)


def slow(n, size):
    """n queued size x size matmuls: later work queues behind them (nothing to do on the CPU)."""
    if dev.type == "cpu":
        return
    a = torch.full((size, size), 1.0 / size, device=dev)
    for _ in range(n):
        a = a @ a


def rs(t, s):
    """t.record_stream(s) (a no-op stand-in on the CPU)."""
    if dev.type != "cpu":
        t.record_stream(s)
'''

NEURON_HEAD = 'dev = torch.device("neuron")\ndm = torch.neuron\nother = "cpu"\n'
STREAMS = "s1 = dm.Stream()\ns2 = dm.Stream()\n"


class CpuStreams:
    """torch.neuron's stream API as no-ops, for the CPU run (one in-order stream)."""

    class Stream:
        def wait_stream(self, other: object) -> None: ...
        def wait_event(self, event: object) -> None: ...
        def synchronize(self) -> None: ...
        def query(self) -> bool:
            return True

    class Event:
        def __init__(self, **kwargs: object) -> None: ...
        def record(self, stream: object = None) -> None: ...
        def wait(self, stream: object = None) -> None: ...
        def synchronize(self) -> None: ...
        def query(self) -> bool:
            return True

    _current = Stream()

    @staticmethod
    def stream(s: object) -> nullcontext:
        return nullcontext()

    @classmethod
    def current_stream(cls) -> Stream:
        return cls._current

    @staticmethod
    def synchronize() -> None: ...


def namespace(device: str, records: list) -> dict:
    """A fresh namespace for a program on `device`; `rec(key, value)` appends (key, host value) to `records`."""
    ns: dict = {}
    exec(PRELUDE, ns)  # noqa: S102  (our own source)
    if device == "cpu":
        ns.update(dev=torch.device("cpu"), dm=CpuStreams, other="meta")
    else:
        exec(NEURON_HEAD, ns)  # noqa: S102
    exec(STREAMS, ns)  # noqa: S102

    def rec(key: str, v: object) -> None:
        records.append((key, host(v)))

    ns["rec"] = rec
    return ns


def host(v: object) -> object:
    """A read's value on the host: tensors as CPU clones (the read is the sync point), lists and numbers as such."""
    if isinstance(v, torch.Tensor):
        return v.cpu().clone()
    return v


# ----------------------------------------------------------------------------------------------- programs


@dataclass(frozen=True)
class Stmt:
    """One statement. `reads`: the names it uses; `writes`: tensors it writes in place (their storages);
    `binds`: names it assigns; `sync`: a sync point or host read; `deferrable`: its error is data-dependent (rule
    2); `group`: statements the minimizer keeps or drops together (a side stream's launch and its join)."""

    src: str
    kind: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    binds: tuple[str, ...] = ()
    sync: bool = False
    deferrable: bool = False
    group: int | None = None


@dataclass
class Program:
    """Its statements and, when made by the generator, the CPU's trace of them (the generator ran them)."""

    seed: int
    stmts: list[Stmt]
    cpu: list[Result] | None = None


@dataclass
class Result:
    """What one statement did on one device: the exception type's name (None: it ran) and message, the values it
    read, and (CPU run) the storage of each tensor it used, wrote and bound."""

    exc: str | None = None
    msg: str = ""
    records: list = field(default_factory=list)
    sids: dict = field(default_factory=dict)


NAME = re.compile(r"\bt\d+\b")
ASYNC_REPORT = "run asynchronously"  # in the message of an error a queued kernel raised (reported later)
POISONED_READ = "never computed"  # ... and of one raised again by a launch or host read of memory it left uncomputed
DATA_DEPENDENT = re.compile(r"out of range|out of bounds|ZeroDivisionError|index \S+ is out of|invalid index",
                            re.IGNORECASE)


# ----------------------------------------------------------------------------------------------- the generator

FLOATS = (torch.float32, torch.bfloat16)
INTS = (torch.int32, torch.int64)
SMALL = [(8,), (5,), (4, 6), (6, 4), (3, 4, 5), (1, 6), (4, 1), (16, 16), (6,)]
LARGE = [(512, 512), (2 ** 18,), (256, 1024), (1024, 256)]
DT = {torch.float32: "torch.float32", torch.bfloat16: "torch.bfloat16", torch.int32: "torch.int32",
      torch.int64: "torch.int64", torch.bool: "torch.bool"}


class Generator:
    """Makes a program statement by statement, running each on the CPU (its namespace holds the CPU tensors).
    `exact` names float tensors whose values carry no rounding (small integers and halves), which alone feed
    comparisons, casts to integers and floor division (an ulp of a fused kernel must not flip them, rule 3)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.r = random.Random(seed)
        self.records: list = []
        self.ns = namespace("cpu", self.records)
        self.env: list[str] = []  # live names, in binding order
        self.exact: set[str] = set()
        self.blocked: set[str] = set()  # used by a side stream not yet joined
        self.stmts: list[Stmt] = []
        self.trace: list[Result] = []  # the CPU run (as `run` would make it)
        self.sid: dict[int, int] = {}
        self.keep: list[torch.Tensor] = []
        self.n = 0
        self.groups = 0
        self.pending_join: Stmt | None = None
        self.pending_join_at = 0

    # -- helpers
    def fresh(self) -> str:
        self.n += 1
        return f"t{self.n - 1}"

    def t(self, name: str) -> torch.Tensor:
        return self.ns[name]

    def pick(self, pred: Callable[[torch.Tensor, str], bool] = lambda t, n: True, allow_blocked: bool = False
             ) -> str | None:
        names = [n for n in self.env if (allow_blocked or n not in self.blocked) and pred(self.t(n), n)]
        if not names:
            return None
        # prefer recent names (a chain of work), but keep the old ones in play
        return names[-1 - min(int(self.r.expovariate(0.4)), len(names) - 1)]

    def aliases(self, name: str) -> list[str]:
        p = self.t(name).untyped_storage().data_ptr()
        return [n for n in self.env if self.t(n).untyped_storage().data_ptr() == p]

    def emit(self, src: str, kind: str, binds: tuple[str, ...] = (), writes: tuple[str, ...] = (), *,
             sync: bool = False, deferrable: bool = False, exact: bool | None = None, group: int | None = None
             ) -> Stmt:
        """Append the statement after running it on the CPU; bound names join the environment if it ran.
        `exact`: its results (and what it writes) stay exact (None: when every float input was exact)."""
        reads = tuple(dict.fromkeys(n for n in NAME.findall(src) if n not in binds))
        st = Stmt(src, kind, reads, writes, binds, sync, deferrable, group)
        self.stmts.append(st)
        self.trace.append(_step(st, self.ns, self.records, self.sid, self.keep))
        ok = self.trace[-1].exc is None
        if exact is None:
            exact = all(n in self.exact or not self.t(n).is_floating_point() for n in reads if n in self.ns)
        for n in writes:
            if not (ok and exact and self._small(n)):
                for a in self.aliases(n):
                    self.exact.discard(a)
        if ok:
            for n in binds:
                self.env.append(n)
                if exact and self._small(n):
                    self.exact.add(n)
        else:
            for n in binds:
                self.ns.pop(n, None)
        return st

    def _small(self, n: str) -> bool:
        """Exact values stay small enough (and on a quarter grid) that every order of additions is exact."""
        t = self.t(n)
        if not t.is_floating_point() or t.numel() == 0:
            return True
        q = t.float() * 4  # (float() of a float32 tensor is the tensor)
        lo, hi = torch.aminmax(q)
        lim = 2 ** 22 if t.dtype == torch.float32 else 2 ** 8
        return -lim <= lo.item() and hi.item() <= lim and torch.equal(q, q.trunc())

    def shape(self, large: float = 0.15) -> tuple[int, ...]:
        return self.r.choice(LARGE if self.r.random() < large else SMALL)

    # -- statement kinds
    def create(self) -> None:
        dtype = self.r.choice([torch.float32, torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.bool])
        shape = self.shape()
        name = self.fresh()
        r = self.r.random()
        if dtype.is_floating_point:
            kind = "int" if r < 0.6 else "randn"
        elif dtype == torch.bool:
            kind = "bool"
        else:
            kind = "pos" if r < 0.2 else "int"
        if r < 0.8 or dtype == torch.bool:
            self.emit(f"{name} = mk({shape}, {DT[dtype]}, {self.r.randrange(10 ** 6)}, {kind!r})", "create", (name,),
                      exact=kind != "randn")
        elif r < 0.9:
            self.emit(f"{name} = torch.full({shape}, {self.r.choice([0, 1, 3, -2])}, dtype={DT[dtype]}, device=dev)",
                      "create", (name,), exact=True)
        else:
            n = self.r.choice([8, 6, 2 ** 18])
            self.emit(f"{name} = torch.arange({n}, dtype={DT[dtype]}, device=dev)", "create", (name,),
                      exact=dtype != torch.bfloat16)

    def unary(self) -> None:
        a = self.pick()
        if a is None:
            return self.create()
        t, name = self.t(a), self.fresh()
        if t.dtype == torch.bool:
            ops = [(f"~{a}", True), (f"{a}.int()", True), (f"{a}.float()", True), (f"{a}.logical_not()", True)]
        elif t.is_floating_point():
            ops = [(f"{a}.abs()", None), (f"-{a}", None), (f"{a} * 0.5", None), (f"{a}.relu()", None),
                   (f"{a}.exp()", False), (f"{a}.sigmoid()", False), (f"torch.tanh({a})", False),
                   (f"{a} + 1", None), (f"{a}.to(torch.bfloat16)", False), (f"{a}.float()", None),
                   (f"{a}.clamp(-2, 2)", None), (f"{a}.sqrt()", False)]
            if a in self.exact:
                ops += [(f"({a} > 0)", True), (f"{a}.long()", True), (f"{a}.int()", True), (f"({a} == 1)", True),
                        (f"torch.floor_divide({a}, 2)", True), (f"{a}.floor()", True)]
        else:
            ops = [(f"{a}.abs()", True), (f"-{a}", True), (f"{a} * 3", True), (f"{a} + 1", True),
                   (f"{a}.float()", True), (f"({a} > 0)", True), (f"{a} // 2", True), (f"{a} % 3", True),
                   (f"{a}.long()", True), (f"{a}.to(torch.int32)", True), (f"{a}.clamp(min=0)", True)]
        src, exact = self.r.choice(ops)
        self.emit(f"{name} = {src}", "unary", (name,), exact=exact)

    def binary(self) -> None:
        a = self.pick()
        if a is None:
            return self.create()
        ta = self.t(a)
        r = self.r.random()
        if r < 0.75:
            b = self.pick(lambda t, n: t.shape == ta.shape and n != a) or a
        elif r < 0.9:
            b = self.pick(lambda t, n: _broadcastable(t.shape, ta.shape)) or a
        else:
            b = self.pick() or a  # often a host-checkable broadcasting error
        tb = self.t(b)
        if _broadcastable(ta.shape, tb.shape) and torch.broadcast_shapes(ta.shape, tb.shape).numel() > 2 ** 20:
            return  # (a 2**18 x 2**18 result: an allocation failure, not an interesting one)
        name = self.fresh()
        ints = not ta.is_floating_point() and not tb.is_floating_point() and ta.dtype != torch.bool != tb.dtype
        bools = ta.dtype == torch.bool and tb.dtype == torch.bool
        ops = [(f"{a} + {b}", None), (f"{a} * {b}", None), (f"{a} - {b}", None), (f"torch.maximum({a}, {b})", None),
               (f"torch.minimum({a}, {b})", None)]
        if bools:
            ops = [(f"{a} & {b}", True), (f"{a} | {b}", True), (f"{a} ^ {b}", True), (f"{a} == {b}", True)]
        if ints:  # integer division by zero: a data-dependent device-side error
            ops += [(f"{a} // {b}", "div"), (f"{a} % {b}", "div"), (f"torch.remainder({a}, {b})", "div"),
                    (f"torch.div({a}, {b}, rounding_mode='floor')", "div"),
                    (f"torch.div({a}, {b}, rounding_mode='trunc')", "div")]
        if a in self.exact and b in self.exact or ints:
            ops += [(f"({a} > {b})", True), (f"({a} == {b})", True)]
        if ta.is_floating_point() or tb.is_floating_point():
            ops += [(f"{a} / {b}", False)]
        if a in self.exact and b in self.exact:  # atan2 jumps by pi with the sign of a rounded operand near zero
            ops += [(f"torch.atan2({a}.float(), {b}.float())", False)]
        c = self.pick(lambda t, n: t.dtype == torch.bool)
        if c is not None:
            ops.append((f"torch.where({c}, {a}, {b})", None))
        src, exact = self.r.choice(ops)
        if exact == "div":
            if self.r.random() < 0.6:  # the same signature first with a divisor free of zeros, then queued
                nz, w = self.fresh(), self.fresh()
                self.emit(f"{nz} = {b}.abs() + 1", "unary", (nz,))
                self.emit(f"{w} = {_rename(src, b, nz)}", "int_div", (w,), exact=True, deferrable=True)
                self.slow()
            return self.emit(f"{name} = {src}", "int_div", (name,), exact=True, deferrable=True)
        self.emit(f"{name} = {src}", "binary", (name,), exact=exact)

    def reduction(self) -> None:
        a = self.pick(lambda t, n: t.dim() >= 1 and t.numel() > 0)
        if a is None:
            return self.create()
        t, name = self.t(a), self.fresh()
        d = self.r.randrange(t.dim())
        ops = [(f"{a}.sum({d})", None), (f"{a}.sum()", None), (f"{a}.amax({d})", None),
               (f"{a}.cumsum({d})", None), (f"{a}.argmax({d})", True), (f"{a}.any({d})", True)]
        if t.is_floating_point():
            ops += [(f"{a}.mean({d})", False), (f"torch.softmax({a}, {d})", False),
                    (f"{a}.float().norm()", False)]
        if t.dtype == torch.bool:
            ops = [(f"{a}.sum({d})", True), (f"{a}.any({d})", True), (f"{a}.all()", True)]
        src, exact = self.r.choice(ops)
        if t.dtype == torch.bfloat16 and ("sum" in src or "cumsum" in src):
            exact = False  # bfloat16 accumulates in float and rounds at the end; partial sums may exceed 256
        self.emit(f"{name} = {src}", "reduction", (name,), exact=exact)

    def matmul(self) -> None:
        a = self.pick(lambda t, n: t.dim() == 2 and t.is_floating_point())
        if a is None:
            return self.create()
        ta = self.t(a)
        if self.r.random() < 0.85:
            b = self.pick(lambda t, n: t.dim() == 2 and t.shape[0] == ta.shape[1] and t.dtype == ta.dtype)
        else:
            b = self.pick(lambda t, n: t.is_floating_point())  # shape/dtype mismatch: host-checkable
        if b is None:
            b = self.fresh()
            self.emit(f"{b} = mk({(ta.shape[1], self.r.choice([4, 6, 512]))}, {DT[ta.dtype]}, "
                      f"{self.r.randrange(10 ** 6)}, 'int')", "create", (b,), exact=True)
        name = self.fresh()
        r = self.r.random()
        exact = None if ta.dtype == torch.float32 == self.t(b).dtype else False  # bfloat16 rounds the sums
        if r < 0.8:
            self.emit(f"{name} = {a} @ {b}", "matmul", (name,), exact=exact)
        else:  # out= of the wrong dtype or shape: host-checkable
            used = set(self.aliases(a)) | set(self.aliases(b))  # an out= aliasing an input is undefined on the CPU
            c = self.pick(lambda t, n: t.dim() == 2 and n not in used)
            if c is None:
                return
            self.emit(f"torch.mm({a}, {b}, out={c})", "matmul_out", writes=(c,), exact=exact)

    def inplace(self) -> None:
        a = self.pick(lambda t, n: t.numel() > 0)
        if a is None:
            return self.create()
        ta = self.t(a)
        target = a
        if self.r.random() < 0.3 and ta.dim() >= 1 and ta.shape[0] > 2:  # through a view
            target = self.r.choice([f"{a}[1:]", f"{a}[::2]", f"{a}.narrow(0, 1, 2)", f"{a}.select(0, 1)"]
                                   + ([f"{a}.t()", f"{a}.diagonal()", f"{a}[:, 1:]"] if ta.dim() == 2 else []))
        b = self.pick(lambda t, n: _broadcastable(t.shape, ta.shape) and n != a) if self.r.random() < 0.6 else None
        if b is None and self.r.random() < 0.2:
            b = self.pick()  # maybe non-broadcastable: host-checkable
        other = b if b is not None else self.r.choice(["2", "3", "-1", "0.5", "0"])
        kind, deferrable, exact = "inplace", False, None
        if ta.dtype == torch.bool:
            ops = [f"{target}.logical_not_()", f"{target}.fill_(True)", f"{target}.zero_()"]
            if b is not None:
                ops += [f"{target}.copy_({b})", f"{target}.logical_or_({b})"]
        else:
            ops = [f"{target}.add_({other})", f"{target}.mul_({other})", f"{target}.sub_({other})",
                   f"{target}.clamp_(-3, 3)", f"{target}.fill_({self.r.choice([0, 1, -2])})", f"{target}.zero_()",
                   f"{target}.clamp_(min=0)", f"{target}.neg_()"]
            if b is not None:
                ops += [f"{target}.copy_({b})", f"{target}.add_({b}, alpha=2)"]
            if not ta.is_floating_point():
                mode = self.r.choice(["'floor'", "'trunc'", "None"])  # None into an int: a host-checkable dtype error
                ops += [f"{target}.div_({other}, rounding_mode={mode})", f"{target}.floor_divide_({other})",
                        f"{target}.remainder_({other})"]
            elif a in self.exact and (b is None or b in self.exact):
                ops += [f"{target}.floor_divide_({other})", f"{target}.remainder_({other})",
                        f"{target}.div_({other}, rounding_mode='floor')"]
            else:
                ops += [f"{target}.div_({other})", f"{target}.exp_()"]
        src = self.r.choice(ops)
        if any(k in src for k in ("div_", "floor_divide_", "remainder_")) and not ta.is_floating_point():
            kind, deferrable = "int_div_", True
        if any(k in src for k in (".div_(", "exp_")) and ta.is_floating_point() and "floor" not in src:
            exact = False
        self.emit(src, kind + ("_view" if target != a else ""), writes=(a,), deferrable=deferrable, exact=exact)

    def view(self) -> None:
        a = self.pick(lambda t, n: t.dim() >= 1 and t.numel() > 1)
        if a is None:
            return self.create()
        t, name = self.t(a), self.fresh()
        n0 = t.shape[0]
        ops = [f"{a}[1:]", f"{a}.narrow(0, {n0 // 2}, {max(1, n0 // 2)})", f"{a}[::2]"]
        if t.dim() == 2:
            ops += [f"{a}.t()", f"{a}.diagonal()", f"{a}[:, :3]", f"{a}.select(1, 0)"]
        if t.is_contiguous():
            ops += [f"{a}.view(-1)", f"{a}.view({t.numel()}, 1)"]
        if 1 in t.shape:
            ops.append(f"{a}.expand({tuple(4 if s == 1 else s for s in t.shape)})")
        if t.dim() >= 1 and n0 > 1:
            ops.append(f"{a}.select(0, {n0 - 1})")
        self.emit(f"{name} = {self.r.choice(ops)}", "view", (name,), exact=a in self.exact or not t.is_floating_point())

    def overlap(self) -> None:
        # contiguous: ATen's overlap check is exact there (strided partial overlaps pass it, and their result follows
        # the kernel's thread split, on the CPU too)
        a = self.pick(lambda t, n: t.dim() >= 1 and t.shape[0] >= 3 and t.is_contiguous())
        if a is None:
            return self.create()
        ops = [f"{a}[1:].copy_({a}[:-1])", f"torch.add({a}[:-1], 1, out={a}[1:])",
               f"{a}[:-1].copy_({a}[1:])"]
        t = self.t(a)
        if 1 in t.shape:
            ops.append(f"{a}.expand({tuple(4 if s == 1 else s for s in t.shape)}).add_(1)")
        if t.dim() == 2 and t.shape[0] == t.shape[1]:
            ops.append(f"{a}.copy_({a}.t())")  # full overlap: allowed (CPU copies through a temporary)
        self.emit(self.r.choice(ops), "overlap", writes=(a,))

    def copy(self) -> None:
        a, b = self.pick(), self.pick()
        if a is None or b is None:
            return self.create()
        self.emit(f"{a}.copy_({b})", "copy", writes=(a,))

    def hostread(self) -> None:
        a = self.pick(lambda t, n: t.numel() > 0)
        if a is None:
            return self.create()
        t = self.t(a)
        key = f"s{len(self.stmts)}"
        r = self.r.random()
        if r < 0.3:
            self.emit(f"rec({key!r}, {a}.cpu())", "read_cpu", sync=True)
        elif r < 0.5:
            self.emit(f"rec({key!r}, {a}.flatten()[{self.r.randrange(t.numel())}].item())", "read_item", sync=True)
        elif r < 0.6 and t.dtype != torch.bfloat16:  # (a bfloat16 sum's item carries bfloat16's rounding)
            self.emit(f"rec({key!r}, {a}.sum().item())", "read_item", sync=True)
        elif r < 0.75 and t.numel() <= 64:
            self.emit(f"rec({key!r}, {a}.tolist())", "read_tolist", sync=True)
        elif r < 0.88 and t.numel() <= 64:
            name = self.fresh()
            self.emit(f"{name} = torch.tensor({a}.tolist(), dtype={DT[t.dtype]}, device=dev)", "roundtrip", (name,),
                      sync=True)
        else:
            name = self.fresh()
            self.emit(f"{name} = {a}.to('cpu', copy=True).to(dev)", "roundtrip", (name,), sync=True)

    def sync(self) -> None:
        self.emit(self.r.choice(["dm.synchronize()", "dm.current_stream().synchronize()"]), "sync", sync=True)

    def slow(self) -> None:
        self.emit(f"slow({self.r.randint(2, 5)}, 512)", "slow")

    def index_tensor(self, dim: int) -> tuple[str, str]:
        """An int64 index tensor into a dimension of `dim`, out of range one time in three (made on the device
        from host values or computed on the device, where the host cannot know it), and a twin of the same
        length in range (to run the op's signature once before, so that the failing call is queued)."""
        name, twin = self.fresh(), self.fresh()
        bad = self.r.random() < 0.35
        vals = [self.r.randrange(dim) for _ in range(self.r.randint(1, 6))]
        self.emit(f"{twin} = torch.tensor({vals}, device=dev)", "index", (twin,), sync=True)
        if bad:
            vals[self.r.randrange(len(vals))] = self.r.choice([dim, dim + 3, -dim - 1])
        if self.r.random() < 0.5:
            self.emit(f"{name} = torch.tensor({vals}, device=dev)", "index", (name,), sync=True)
        else:
            base = self.fresh()
            self.emit(f"{base} = torch.tensor({vals}, device=dev)", "index", (base,), sync=True)
            self.emit(f"{name} = ({base} * 1).long()", "index", (name,))
        return name, twin

    def indexing(self) -> None:
        a = self.pick(lambda t, n: t.dim() >= 1 and t.shape[0] >= 2)
        if a is None:
            return self.create()
        t = self.t(a)
        idx, twin = self.index_tensor(t.shape[0])
        name = self.fresh()
        ops = [(f"{name} = {a}.index_select(0, {idx})", (name,), ()), (f"{name} = {a}[{idx}]", (name,), ())]
        if t.dim() == 2:
            ops += [(f"{name} = {a}.gather(0, {idx}[:, None].expand(-1, {t.shape[1]}))", (name,), ())]
            if t.is_floating_point():
                ops.append((f"{name} = F.embedding({idx}, {a})", (name,), ()))
        tgt = self.pick(lambda u, n: u.dim() >= 1 and u.shape[0] >= 2 and u.dtype == t.dtype
                        and u.shape[1:] == t.shape[1:])
        if tgt is not None and self.t(tgt).shape[0] >= 1:
            m = self.t(tgt).shape[0]
            ops += [(f"{tgt}.index_fill_(0, {idx}.clamp(max={m + 1}), 0)", (), (tgt,))]
            ops += [(f"{tgt}.index_add_(0, {idx}.clamp(max={m + 1}), {a}[:1].expand(len({idx}), *{a}.shape[1:]))",
                     (), (tgt,))]
        src, binds, writes = self.r.choice(ops)
        if self.r.random() < 0.6:  # the same signature first in range, then the call queued behind slow work
            w = self.fresh()
            self.emit(_rename(_rename(src, idx, twin), name, w), "index_op", (w,) if binds else (),
                      tuple(twin if x == idx else x for x in writes), deferrable=True)  # the target may be the index
            self.slow()
        self.emit(src, "index_op", binds, writes, deferrable=True, exact=None)

    def mixed(self) -> None:
        a = self.pick(lambda t, n: t.dim() >= 1 and t.numel() > 1)
        if a is None:
            return self.create()
        name = self.fresh()
        src = self.r.choice([f"{name} = {a} + {a}.to(other)", f"{name} = torch.maximum({a}.to(other), {a})"])
        self.emit(src, "mixed_device", (name,), sync=True)  # `.to(other)` copies to the host: a sync point

    def dtype_out(self) -> None:
        a = self.pick(lambda t, n: t.is_floating_point())
        c = self.pick(lambda t, n: not t.is_floating_point())
        if a is None or c is None:
            return self.create()
        self.emit(f"torch.add({a}, {a}, out={c})", "dtype_out", writes=(c,))

    def side(self) -> None:
        """Work on a side stream, joined now or a few statements later (its names unusable until then)."""
        if self.pending_join is not None:
            return
        a = self.pick(lambda t, n: t.numel() > 0)
        if a is None:
            return self.create()
        self.groups += 1
        g = self.groups
        s = self.r.choice(["s1", "s2"])
        t = self.t(a)
        lines, binds, writes = [f"{s}.wait_stream(dm.current_stream())", f"with dm.stream({s}):"], [], []
        name = self.fresh()
        op = f"{a} * 2" if t.dtype != torch.bool else f"~{a}"
        lines.append(f"    {name} = {op}")
        binds.append(name)
        deferrable = False
        kind = "side"
        r = self.r.random()
        if r < 0.35 and t.dim() >= 1 and t.shape[0] >= 2:  # a failing (maybe) index op on the side stream
            vals = [0, self.r.choice([1, t.shape[0], t.shape[0] + 5])]
            n2, w = self.fresh(), self.fresh()
            lines.append(f"    {w} = {a}.index_select(0, torch.tensor([0, 0], device=dev))")  # its signature first
            binds.append(w)
            lines.append(f"    {n2} = {a}.index_select(0, torch.tensor({vals}, device=dev))")
            binds.append(n2)
            deferrable, kind = True, "side_index"
        elif r < 0.6:
            w = self.pick(lambda u, n: u.dtype != torch.bool and n not in self.aliases(a) and u.numel() > 0)
            if w is not None:
                lines.append(f"    {w}.add_(1)")
                writes.append(w)
        if self.r.random() < 0.4:
            lines.append(f"    rs({a}, {s})")
        join_kind = self.r.choice(["wait_stream", "event", "event_sync", "stream_sync"])
        join = {"wait_stream": f"dm.current_stream().wait_stream({s})",
                "event": f"ev{g} = dm.Event()\nev{g}.record({s})\ndm.current_stream().wait_event(ev{g})",
                "event_sync": f"ev{g} = dm.Event()\nev{g}.record({s})\nev{g}.synchronize()",
                "stream_sync": f"{s}.synchronize()"}[join_kind]
        used = set(NAME.findall("\n".join(lines))) | set(binds)
        if self.r.random() < 0.5:  # joined now, also when the side stream's work raised
            src = "\n".join([lines[0], "try:", *("    " + x for x in lines[1:]), "finally:",
                             *("    " + x for x in join.split("\n"))])
            self.emit(src, kind, tuple(binds), tuple(writes), deferrable=deferrable, group=g,
                      sync=join_kind in ("event_sync", "stream_sync"))
        else:  # join later; until then nobody touches what the side stream uses
            self.emit("\n".join(lines), kind, tuple(binds), tuple(writes), deferrable=deferrable, group=g)
            for n in used:
                self.blocked.update(self.aliases(n) if n in self.ns else [n])
            self.pending_join = Stmt(join, "join", sync=join_kind in ("event_sync", "stream_sync"), group=g)
            self.pending_join_at = len(self.stmts) + self.r.randint(1, 4)

    def loop(self) -> None:
        """A fusable run that recurs (eager fusion compiles a group at its third sighting, then replays it)."""
        a = self.pick(lambda t, n: t.dtype == torch.float32 and tuple(t.shape) == (512, 512) and t.is_contiguous())
        if a is None:
            name = self.fresh()
            self.emit(f"{name} = mk((512, 512), torch.float32, {self.r.randrange(10 ** 6)}, 'int')", "create",
                      (name,), exact=True)
            a = name
        b = self.pick(lambda t, n: t.shape == self.t(a).shape and t.dtype == torch.float32 and n != a
                      and t.is_contiguous() and not set(self.aliases(n)) & set(self.aliases(a)))
        if b is None:
            b = self.fresh()
            self.emit(f"{b} = mk({tuple(self.t(a).shape)}, torch.float32, {self.r.randrange(10 ** 6)}, 'int')",
                      "create", (b,), exact=True)
        # one body, so that a process compiles few groups (Inductor's build of one takes 4-30 s on a loaded box)
        self.emit(f"for _ in range({self.r.randint(4, 6)}):\n    slow(1, 512)\n    {a}.mul_(0.5).add_({b})", "loop",
                  writes=(a,))

    KINDS = (("create", 8), ("unary", 10), ("binary", 12), ("reduction", 5), ("matmul", 4), ("inplace", 12),
             ("view", 6), ("overlap", 2), ("copy", 3), ("hostread", 7), ("sync", 2), ("slow", 5), ("indexing", 6),
             ("mixed", 1), ("dtype_out", 1), ("side", 5), ("loop", 1))

    def program(self, length: int) -> Program:
        names, weights = zip(*self.KINDS, strict=True)
        for _ in range(3):
            self.create()
        while len(self.stmts) < length:
            if self.pending_join is not None and len(self.stmts) >= self.pending_join_at:
                self._join()
            getattr(self, self.r.choices(names, weights)[0])()
        if self.pending_join is not None:
            self._join()
        self.emit("dm.synchronize()", "final_sync", sync=True)
        for n in self.env:
            self.emit(f"rec({n!r}, {n})", "final_read", sync=True)
        return Program(self.seed, self.stmts, self.trace)

    def _join(self) -> None:
        j = self.pending_join
        self.pending_join = None
        self.emit(j.src, j.kind, sync=j.sync, group=j.group)
        self.blocked.clear()


def _rename(src: str, old: str, new: str) -> str:
    return re.sub(rf"\b{old}\b", new, src)


def _broadcastable(a: tuple, b: tuple) -> bool:
    try:
        torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return True


def generate(seed: int, length: int | None = None) -> Program:
    r = random.Random(seed * 7919 + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Generator(seed).program(length if length is not None else r.randint(10, 24))


# ----------------------------------------------------------------------------------------------- running


def set_mode(mode: str) -> None:
    """Enter `mode` on the device (after draining it)."""
    from torchneuron import _C

    _C._set_launch_blocking(mode == "blocking")
    _C._set_queue_everything(mode == "queue")


def mode_now() -> str:
    """The device's mode: what a CI leg set (TORCHNEURON_LAUNCH_BLOCKING=1, --queue-everything) or `set_mode`."""
    from torchneuron import _C

    return "blocking" if _C._launch_blocking() else "queue" if _C._queue_everything() else "default"


def drain() -> str | None:
    """Wait for the device; the type of an error still pending (a program must leave none), else None."""
    leftover = None
    for _ in range(3):
        try:
            torch.neuron.synchronize()
            return leftover
        except Exception as e:  # noqa: BLE001
            leftover = leftover or type(e).__name__
    return leftover


def run(prog: Program, device: str, cpu: list[Result] | None = None) -> list[Result]:
    """Each statement's Result on `device`. On neuron, `cpu` (the CPU's trace) names the statements whose names
    are dropped after they ran (the CPU bound none). The CPU run records each used tensor's storage."""
    trace: list[Result] = []
    records: list = []
    ns = namespace(device, records)
    sid: dict[int, int] = {}
    keep: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # out= resizes, dtype policy notes
        for i, st in enumerate(prog.stmts):
            trace.append(_step(st, ns, records, sid if device == "cpu" else None, keep))
            if device != "cpu" and cpu is not None and cpu[i].exc is not None:
                for n in st.binds:
                    ns.pop(n, None)
    ns.clear()
    return trace


def _step(st: Stmt, ns: dict, records: list, sid: dict[int, int] | None, keep: list) -> Result:
    """Run one statement in `ns`. With `sid` (the CPU run), record the storage of each tensor it used, wrote and
    bound; `keep` holds every bound tensor alive, so that a storage address names one storage."""
    def storages(names: tuple[str, ...]) -> dict:
        out = {}
        for n in names:
            v = ns.get(n)
            if isinstance(v, torch.Tensor):
                out[n] = sid.setdefault(v.untyped_storage().data_ptr(), len(sid))
        return out

    res = Result()
    if sid is not None:
        res.sids = storages(st.reads + st.writes)
    try:
        exec(st.src, ns)  # noqa: S102
    except Exception as e:  # noqa: BLE001  (a failing statement is part of the program)
        res.exc, res.msg = type(e).__name__, str(e).split("\n")[0][:300]
    res.records, records[:] = list(records), []
    if sid is not None:
        if res.exc is None:
            res.sids.update(storages(st.binds))
        keep.extend(ns[n] for n in st.binds if isinstance(ns.get(n), torch.Tensor))
    return res


# ----------------------------------------------------------------------------------------------- comparing


@dataclass(frozen=True)
class Mismatch:
    """A broken rule at statement `index`: `what` says what neuron did against the CPU."""

    rule: int
    index: int
    kind: str
    what: str

    @property
    def cls(self) -> tuple[int, str]:
        return self.rule, self.kind


def _same(c: object, n: object, exact: bool) -> bool:
    if isinstance(c, torch.Tensor):
        if not isinstance(n, torch.Tensor) or c.dtype != n.dtype or c.shape != n.shape:
            return False
        if c.is_floating_point() and not exact:  # rounding of sums in another order: relative to the largest value
            tol = 1e-5 if c.dtype == torch.float32 else 2 ** -7
            finite = c[c.isfinite()]
            scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
            return torch.allclose(n.float(), c.float(), rtol=tol, atol=tol * scale, equal_nan=True)
        return torch.equal(c, n) or (c.is_floating_point() and bool(
            ((c == n) | (c.isnan() & n.isnan())).all()))
    if isinstance(c, float) and isinstance(n, float):
        if exact:
            return c == n or (c != c and n != n)
        if c == n or (c != c and n != n):
            return True
        return math.isfinite(c) and abs(c - n) <= 1e-5 * max(1.0, abs(c)) * 64  # an infinity only equals itself
    if isinstance(c, list) and isinstance(n, list):
        return len(c) == len(n) and all(_same(x, y, exact) for x, y in zip(c, n, strict=True))
    return type(c) is type(n) and c == n


def _short(v: object) -> str:
    if isinstance(v, torch.Tensor):
        flat = v.flatten()[:6].tolist()
        return f"tensor{tuple(v.shape)} {v.dtype} {flat}{'...' if v.numel() > 6 else ''}"
    s = repr(v)
    return s if len(s) < 120 else s[:117] + "..."


def compare(prog: Program, cpu: list[Result], neu: list[Result], mode: str, exact: bool = False) -> list[Mismatch]:
    """The rules of the module docstring, statement by statement; the first mismatch of each statement."""
    out: list[Mismatch] = []
    tainted: dict[int, set[int]] = {}  # tainted storage -> the failing statements whose failure it carries
    pending: list[tuple[str, int]] = []  # deferred errors not yet surfaced: (type, statement)
    later: list[tuple[str, int]] = []  # pending when another surfaced: reported with it, or at a later sync point
    seen: set[str] = set()  # types of every deferred error so far
    lost: set[str] = set()
    diverged: set[int] = set()  # storages that differ because of a mismatch already reported: not compared again

    def surface(exc: str, behind: set[int] = frozenset()) -> None:
        """A pending failure of type `exc` was raised (one of the statements `behind` the data read, if any is of
        that type): those pending beside it (on other streams, or behind it on its stream) may still surface later,
        each once."""
        nonlocal pending
        types = [j for j, (p, _) in enumerate(pending) if p == exc]
        named = next((j for j in types if pending[j][1] in behind), types[0])
        later.extend(pending[:named] + pending[named + 1:])
        pending = []

    def taint(sids: set[int], by: set[int]) -> None:
        for x in sids:
            tainted.setdefault(x, set()).update(by)

    for i, (st, c, n) in enumerate(zip(prog.stmts, cpu, neu, strict=True)):
        def bad(rule: int, what: str, st: Stmt = st, i: int = i) -> None:
            out.append(Mismatch(rule, i, st.kind, what))

        sids = c.sids
        reads = {sids[x] for x in st.reads if x in sids}
        writes = {sids[x] for x in st.writes if x in sids}
        binds = {sids[x] for x in st.binds if x in sids}
        behind = set().union(*(tainted[x] for x in reads if x in tainted))  # failures the read data carries
        dep = bool(behind) or bool(set(st.reads) & lost)
        # which failure a surfacing raised: a launch or read of poisoned memory one of those behind that memory (its
        # message says so), else a sync point its stream's oldest unseen one
        by_poison = n.exc is not None and POISONED_READ in n.msg
        named_by = behind if by_poison or not st.sync else frozenset()
        # the failures another surfacing did not name that this one may be: by its sync point, or behind what it reads
        held = [k for k, (p, j) in enumerate(later)
                if p == n.exc and (j in behind if by_poison else st.sync or j in behind)]
        if reads & diverged:
            diverged |= writes | binds
        nbad = len(out)
        if c.exc is not None:
            data = st.deferrable and bool(DATA_DEPENDENT.search(c.msg))
            if data:
                taint(writes, {i})
            # this statement's own error, or an earlier statement's deferred one (of the same type by chance)
            own = n.exc == c.exc and not (ASYNC_REPORT in n.msg and not n.msg.startswith(c.msg[:40]))
            reported = not own and n.exc in {p for p, _ in pending}
            if own:
                if ASYNC_REPORT in n.msg and n.exc in {p for p, _ in pending} and mode != "blocking":
                    # the same type and message as a pending one: that may be what surfaced here (a side block's
                    # sync point raising its stream's older failure over this one), so it may surface later or not
                    surface(n.exc, named_by)
                if data:
                    seen.add(c.exc)
                    # raised at the call on both: each kernel stopped part way, after a split that follows its own
                    # thread count, so what it wrote is unspecified on both (as a failed op's output on the CPU)
                    diverged |= writes
            elif n.exc is None:
                if data and mode != "blocking":
                    pending.append((c.exc, i))
                    seen.add(c.exc)
                else:
                    bad(4 if data else 1, f"CPU raised {c.exc} ({c.msg}); neuron raised nothing")
            elif reported and mode != "blocking" and (st.sync or (data and dep)):
                # an earlier error surfaced at this statement's sync point (a copy to the host) or dependent read,
                # before the op's own check or launch: this one (a device-side error) is pending now
                surface(n.exc, named_by)
                if data:
                    # pending now; in a block whose `finally:` syncs, it may have been raised at the call and
                    # replaced by the older failure the finally raised, so it may surface later or not
                    (later if "finally:" in st.src else pending).append((c.exc, i))
                    seen.add(c.exc)
            elif n.exc == "NameError" and set(st.reads) & lost:
                pass
            elif by_poison and n.exc in seen and dep:
                pass  # a part of the statement read poisoned memory (`.to("cpu")` of it) before the op's own check
            elif held and mode != "blocking" and (st.sync or dep):
                del later[held[0]]  # an older failure surfaced at the statement's sync point, before its own check
            elif n.exc == "OutOfMemoryError" and "can't allocate memory" in c.msg:
                pass  # the device's allocator raises torch.OutOfMemoryError (a RuntimeError), as CUDA's does
            elif reported:  # a pending error surfaced here, in place of this one's
                bad(4 if mode == "blocking" else 1, f"CPU raised {c.exc} ({c.msg}); neuron raised the pending "
                    f"{n.exc} of statement {pending[0][1]} instead ({n.msg})")
                surface(n.exc)
                if data and mode != "blocking":
                    pending.append((c.exc, i))
            else:
                bad(4 if mode == "blocking" else 1, f"CPU raised {c.exc} ({c.msg}); neuron raised {n.exc} ({n.msg})")
            if n.exc is None and not (data and mode != "blocking"):
                diverged |= writes  # the neuron ran what the CPU refused
        elif n.exc is not None:
            surfaced = mode != "blocking" and n.exc in {p for p, _ in pending} and (st.sync or dep)
            # a failure another surfacing did not name (another stream's, carried by an event wait to a stream that
            # had failed itself): each failure is raised once, so it may surface at a later sync point
            carried = mode != "blocking" and bool(held) and (st.sync or dep)
            poisoned = n.exc in seen and dep
            if surfaced or carried or poisoned or (n.exc == "NameError" and set(st.reads) & lost):
                if surfaced:
                    surface(n.exc, named_by)
                elif carried:  # the older failure this stream held is raised here: those after it may surface later
                    del later[held[0]]
                    later += pending
                    pending = []
                taint(writes | binds, behind)
                diverged |= writes  # it raised on neuron: its later writes did not happen there (an op that raises
                lost |= set(st.binds)  # writes nothing), while the CPU made them
            else:
                why = ("pending: " + ", ".join(f"{p} of statement {j}" for p, j in pending)) if pending else \
                      "no error pending"
                if n.exc in {p for p, _ in pending}:
                    surface(n.exc)  # it surfaced, at the wrong statement (reported once, here)
                diverged |= writes | binds
                lost |= set(st.binds)
                bad(4 if mode == "blocking" else (2 if pending or seen else 1),
                    f"neuron raised {n.exc} ({n.msg}) where the CPU ran ({why}; "
                    f"{'a sync point' if st.sync else 'not a sync point'}; "
                    f"{'reads tainted data' if dep else 'reads no tainted data'})")
        elif dep:
            taint(writes | binds, behind)
        nrec = dict(n.records)
        if reads & diverged and len(out) == nbad:
            continue  # a consequence of an earlier mismatch
        for key, cv in c.records:
            if key in nrec and not _same(cv, nrec[key], exact):
                bad(3, f"read {key}: neuron {_short(nrec[key])}, CPU {_short(cv)}"
                    + (" (tainted)" if dep else ""))
                break
    if pending:
        out.append(Mismatch(2, len(prog.stmts) - 1, prog.stmts[pending[0][1]].kind,
                            "deferred error(s) never surfaced: "
                            + ", ".join(f"{p} of statement {j}" for p, j in pending)))
    return out


# ----------------------------------------------------------------------------------------------- driving


@dataclass
class Outcome:
    """One program in one mode."""

    prog: Program
    mode: str
    mismatches: list[Mismatch]
    cpu: list[Result]
    neu: list[Result]
    leftover: str | None = None  # an error the device still held after the program (never reported by it)


def fusion_exact() -> bool:
    """Floats compare exactly when eager fusion is off (TORCHNEURON_EAGER_FUSION=0): the device then runs the
    CPU's own kernels."""
    from torchneuron.compiler import eager_fusion

    return not eager_fusion.enabled()


def check(prog: Program, mode: str, cpu: list[Result] | None = None) -> Outcome:
    """Run `prog` on the CPU (unless given) and on neuron in `mode`; compare."""
    if cpu is None:
        cpu = prog.cpu if prog.cpu is not None else run(prog, "cpu")
    before = drain()
    was = mode_now()
    set_mode(mode)
    try:
        neu = run(prog, "neuron", cpu)
        leftover = drain()
        gc.collect()  # the program's tensors are gone: none of its memory may stay poisoned for the next tensor there
        poisoned = torchneuron._C._poisoned_storages()
    finally:
        set_mode(was)
    mism = compare(prog, cpu, neu, mode, exact=fusion_exact())
    if before is not None:
        mism.insert(0, Mismatch(2, 0, "previous_program", f"an error of an earlier program surfaced: {before}"))
    if leftover is not None:
        mism.append(Mismatch(2, len(prog.stmts) - 1, "after_end", f"the device still held {leftover} after the "
                             "program's final synchronize and reads"))
    if poisoned:
        mism.append(Mismatch(3, len(prog.stmts) - 1, "poison_after_end", f"{poisoned} storages stayed poisoned after "
                             "the program's tensors were freed (the next tensors at those addresses would raise)"))
    return Outcome(prog, mode, mism, cpu, neu, leftover)


def minimize(out: Outcome, budget_s: float = 60.0) -> Outcome:
    """Drop statements (a side stream's launch and join together) while a mismatch of the same class persists."""
    target = {m.cls for m in out.mismatches}
    deadline = time.monotonic() + budget_s
    best = out

    def units(stmts: list[Stmt]) -> list[list[int]]:
        us: dict = {}
        for j, s in enumerate(stmts):
            if s.kind != "final_sync":  # kept: the end of the program, where deferred errors must have surfaced
                us.setdefault(("g", s.group) if s.group is not None else ("s", j), []).append(j)
        return list(us.values())

    chunk = max(1, len(units(best.prog.stmts)) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        changed = False
        us = units(best.prog.stmts)
        k = 0
        while k < len(us) and time.monotonic() < deadline:
            drop = {j for u in us[k:k + chunk] for j in u}
            trial = Program(best.prog.seed, [s for j, s in enumerate(best.prog.stmts) if j not in drop])
            o = check(trial, best.mode)
            if {m.cls for m in o.mismatches} & target:
                best, changed = o, True
                us = units(best.prog.stmts)
            else:
                k += chunk
        if not changed:
            chunk //= 2
    return best


def repro(out: Outcome) -> str:
    """The program as runnable Python on neuron (in its mode), each statement's CPU and neuron outcome beside it."""
    lines = [f"# torchneuron fuzz repro: seed {out.prog.seed}, mode {out.mode}",
             *[f"# rule {m.rule}, statement {m.index} ({m.kind}): {m.what}" for m in out.mismatches],
             "import torchneuron", PRELUDE, NEURON_HEAD, STREAMS,
             "def rec(key, v):\n    print(key, v.cpu() if isinstance(v, torch.Tensor) else v)\n"]
    if out.mode != "default":
        lines.append(f"torchneuron._C._set_{'launch_blocking' if out.mode == 'blocking' else 'queue_everything'}"
                     "(True)\n")
    for i, (st, c, n) in enumerate(zip(out.prog.stmts, out.cpu, out.neu, strict=True)):
        lines.append(f"# [{i}] {st.kind}: CPU {c.exc or 'ok'}, neuron {n.exc or 'ok'}"
                     + "".join(f"; read {k}: CPU {_short(v)}" for k, v in c.records[:1])
                     + "".join(f" / neuron {_short(v)}" for k, v in n.records[:1]))
        lines.append("try:\n" + textwrap.indent(st.src, "    ")
                     + f"\nexcept Exception as e:\n    print({i}, type(e).__name__, str(e)[:200])")
    return "\n".join(lines) + "\n"


def traces(out: Outcome) -> str:
    rows = []
    for i, (st, c, n) in enumerate(zip(out.prog.stmts, out.cpu, out.neu, strict=True)):
        rows.append(f"{i:3d} {st.kind:14s} cpu={c.exc or 'ok':14s} neuron={n.exc or 'ok':14s} "
                    + st.src.replace("\n", "; ")[:100])
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------- findings

_BIND = re.compile(r"^\s*(t\d+) = ", re.MULTILINE)
_WRITE = re.compile(r"^\s*(t\d+)\b[^=]*?\.(\w+_)\(|out=(t\d+)", re.MULTILINE)
_SYNC = re.compile(r"rec\(|synchronize\(|\.item\(|tolist\(|torch\.tensor\(|\.to\('cpu'")
_DEFER = re.compile(r"index_select|gather|embedding|index_add_|index_fill_|\[t\d+\]|//|%|div|remainder|floor_divide")


def parse(lines: list[str], seed: int = 0) -> Program:
    """A hand-written program: each statement's names, writes, sync and data dependence read off its source (the
    generator's conventions: tensors are t<N>, in-place ops end in `_`)."""
    stmts = []
    for src in lines:
        binds = tuple(dict.fromkeys(_BIND.findall(src)))
        writes = tuple(dict.fromkeys(a or b for a, _, b in _WRITE.findall(src) if (a or b) not in binds))
        reads = tuple(dict.fromkeys(n for n in NAME.findall(src) if n not in binds))
        stmts.append(Stmt(src, "final_read" if src.startswith("rec(") else "hand", reads, writes, binds,
                          bool(_SYNC.search(src)), bool(_DEFER.search(src))))
    return Program(seed, stmts)


@dataclass(frozen=True)
class Finding:
    """A class of mismatch the runtime still has: a program whose first mismatch
    matches one of `rules`, one of `kinds` (empty: any) and `pattern` (on Mismatch.what) belongs to it; `lines` is its
    minimal repro, run in `mode`."""

    id: str
    title: str
    rules: tuple[int, ...]
    kinds: tuple[str, ...]
    pattern: str
    lines: tuple[str, ...]
    mode: str = "default"

    def program(self) -> Program:
        return parse(list(self.lines))

    def matches(self, m: Mismatch) -> bool:
        return (m.rule in self.rules and (not self.kinds or m.kind in self.kinds)
                and bool(re.search(self.pattern, m.what)))


_WARM = ("t0 = mk((512, 512), torch.float32, 1, 'int')", "t1 = torch.tensor([0, 1], device=dev)",
         "t2 = t0.index_select(0, t1)", "t9 = t0 * 2")  # each signature once, so that later calls are queued

# Open findings: none. F1-F6 (queued copy_/in-place shape and overlap checks deferred, garbage after a failed kernel,
# a deferred error raised by an unrelated launch, the same on a side stream, a second stream's error outliving
# synchronize) were fixed by the runtime's poisoning and call-time checks (docs/device.md); a new class goes here as
# Finding(id, title, modes, rules, pattern, repro) with its minimal program, until the runtime fixes it.
FINDINGS: tuple[Finding, ...] = ()


def finding(m: Mismatch) -> Finding | None:
    return next((f for f in FINDINGS if f.matches(m)), None)


def sample(mode: str, n: int, seed: int = 0) -> tuple[list[Outcome], dict[str, list[int]]]:
    """Run `n` programs in `mode` (seeds `seed + 1e6 * mode index` on): the outcomes whose first mismatch belongs
    to no open finding, and the seeds of the others by finding."""
    base = seed + 1_000_000 * MODES.index(mode)
    unknown: list[Outcome] = []
    known: dict[str, list[int]] = {}
    for s in range(base, base + n):
        out = check(generate(s), mode)
        if out.mismatches:
            f = finding(out.mismatches[0])
            if f is None:
                unknown.append(out)
            else:
                known.setdefault(f.id, []).append(s)
    return unknown, known


def main(argv: list[str] | None = None) -> int:
    """The long mode for release checks: `python -m tests.fuzz_programs --programs 5000` (split over the modes)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--programs", type=int, default=300, help="programs in all, split over the modes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    failed = 0
    for mode in modes:
        t = time.monotonic()
        n = args.programs // len(modes)
        unknown, known = sample(mode, n, args.seed)
        failed += len(unknown)
        print(f"{mode}: {n} programs in {time.monotonic() - t:.0f} s; {len(unknown)} with a new mismatch; open "
              "findings first: " + (", ".join(f"{k} {len(v)}" for k, v in sorted(known.items())) or "none"))
        if unknown:
            out = minimize(unknown[0])
            print(f"first new mismatch (seed {out.prog.seed}), minimized:\n{repro(out)}\n{traces(out)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
