"""The `neuron` c10d backend: torch.distributed collectives on neuron tensors, carried by gloo.

Device memory is host memory, so each collective hands gloo CPU tensors that alias the neuron tensors' memory
(`_C._host_alias`, no copy) and gloo reads and writes device memory in place. Before each collective the ranks
exchange a small fingerprint (op, sequence number, root, reduce op, dtype, shapes or all-to-all counts), so a
mismatch raises a clear error on every rank instead of gloo aborting, hanging or silently truncating; a rank
that died or hangs fails that exchange (or the transfer) within the group's timeout, naming the collective.
"""
from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .. import _C
from ..hardware import config

ReduceOp = dist.ReduceOp
RedOpType = dist.ReduceOp.RedOpType
Tensors = Sequence[torch.Tensor]

# Collectives by fingerprint code (their torch.distributed names, used in error messages).
OPS = ("barrier", "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
       "all_gather_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "reduce_scatter",
       "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all", "all_to_all_single",
       "gather", "scatter")
_DTYPES = tuple(dict.fromkeys(d for d in vars(torch).values() if isinstance(d, torch.dtype)))
_MAX_DIMS = 6  # dims of the first tensor a fingerprint carries (for messages)


class Fingerprint(NamedTuple):
    """What one rank is about to run, exchanged (as one int64 row) before each collective: every rank must have
    the same call fields, and what each sends to a peer must be what that peer receives (all-to-all)."""

    seq: int
    op: int  # index into OPS
    root: int  # -1: no root
    redop: int  # RedOpType value, -1: no reduction
    dtype: int  # index into _DTYPES of the first tensor, -1: no tensors
    count: int  # tensors
    numel: int  # elements in all
    shapes: int  # hash of every (shape, dtype)
    ndim: int  # of the first tensor
    dims: tuple[int, ...]  # the first tensor's first _MAX_DIMS dims, padded with -1
    send: tuple[int, ...]  # elements sent to each rank (all-to-all), else -1 per rank
    recv: tuple[int, ...]  # elements received from each rank (all-to-all), else -1 per rank

    def row(self) -> list[int]:
        return [*self[:9], *self.dims, *self.send, *self.recv]

    @classmethod
    def from_row(cls, row: list[int], n: int) -> Fingerprint:
        return cls(*row[:9], tuple(row[9:9 + _MAX_DIMS]), tuple(row[9 + _MAX_DIMS:9 + _MAX_DIMS + n]),
                   tuple(row[9 + _MAX_DIMS + n:]))

    def same_call(self, other: Fingerprint) -> bool:
        return self[:10] == other[:10]  # everything but the per-peer counts

    def describe(self) -> str:
        """This rank's fingerprint in words, for the mismatch error."""
        parts = [f"{OPS[self.op]} (collective #{self.seq})"]
        if self.root >= 0:
            parts.append(f"root {self.root}")
        if self.redop >= 0:
            parts.append(f"op {RedOpType(self.redop).name}")
        if self.count:
            shape = [*self.dims[:min(self.ndim, _MAX_DIMS)], *(["..."] if self.ndim > _MAX_DIMS else [])]
            parts.append(f"{self.count} tensor(s), first {str(_DTYPES[self.dtype]).removeprefix('torch.')}"
                         f"[{', '.join(map(str, shape))}], {self.numel} elements in all")
        if self.send and self.send[0] >= 0:
            parts.append(f"sends {list(self.send)} elements to ranks 0..{len(self.send) - 1}, "
                         f"receives {list(self.recv)}")
        return ", ".join(parts)


class Reduction(NamedTuple):
    """How gloo runs a reduce op: gloo has no AVG or PREMUL_SUM, so SUM, scaling the inputs or dividing the
    outputs."""

    op: ReduceOp
    scale: Any  # PREMUL_SUM's factor (multiplies the inputs), else None
    divisor: int | None  # AVG's world size (divides the outputs), else None


def host_view(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor on the memory of `t` (no copy): what gloo reads and writes."""
    return _C._host_alias(t) if t.device.type == "neuron" else t


def _views(tensors: Tensors) -> list[torch.Tensor]:
    return [host_view(t) for t in tensors]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The flat host view of a contiguous tensor: the `*_into_tensor` collectives match elements, not shapes
    (as NCCL does: an output of world x numel elements in any shape), while gloo compares chunk shapes."""
    if not t.is_contiguous():
        raise ValueError(f"neuron: all_gather_into_tensor needs contiguous tensors, got strides {t.stride()}")
    return host_view(t).view(-1)


def checks_enabled() -> bool:
    """TORCHNEURON_DIST_CHECKS=0 skips the per-collective agreement check (one small allgather)."""
    return config.current().dist_checks


def _reduction(op: ReduceOp, size: int) -> Reduction:
    kind = op.op
    if kind == RedOpType.AVG:
        return Reduction(ReduceOp.SUM, None, size)
    if kind == RedOpType.PREMUL_SUM:
        return Reduction(ReduceOp.SUM, op.factor, None)
    return Reduction(ReduceOp(kind), None, None)


def _divide(tensors: Tensors, n: int) -> None:
    """AVG's last step, on host views: it runs on gloo's thread when the transfer completes."""
    for t in map(host_view, tensors):
        t.copy_(t.div(n) if t.is_floating_point() else t.div(n, rounding_mode="trunc"))


def _finish_reduction(name: str, tensors: Tensors, divisor: int | None) -> None:
    """After a reduction: AVG's division, then the dtype policy, since the sum is a new value computed for the
    device (float64 sums carry float32 precision, as any device op's results)."""
    if divisor is not None:
        _divide(tensors, divisor)
    for t in tensors:
        _C._note_device_result(f"c10d::{name}", t)


class HeldWorks:
    """gloo's run loop drops its reference to a work at the end of its loop iteration, holding the group's work
    mutex. Were that the last reference, freeing the work's tensors would take the GIL (their Python objects), while a
    thread that holds the GIL and destroys the group (DDP's reducer going away at the end of a script) waits for that
    mutex: the process hangs (seen once in ~190 runs of a DDP script). So a group keeps each of gloo's works and drops
    it on a Python thread once gloo has let go of it; when the group goes, it waits for gloo to let go of the last
    ones and drops them too (a held work keeps gloo's context, and with it the group's store, alive)."""

    def __init__(self) -> None:
        self.works: list[dist.Work] = []

    def add(self, works: Sequence[dist.Work]) -> None:
        self.works[:] = [w for w in self.works if not _C._sole_holder(w)]
        self.works.extend(works)

    @staticmethod
    def release(works: list[dist.Work], patience: float = 5.0) -> None:
        """The group is gone: drop the works once gloo let go of them (at most `patience` seconds; a work gloo still
        runs after that, a collective that never completes, is left to the process)."""
        deadline = time.monotonic() + patience
        while any(not _C._sole_holder(w) for w in works) and time.monotonic() < deadline:
            time.sleep(0.001)
        _STRANDED.extend(w for w in works if not _C._sole_holder(w))
        works.clear()


_STRANDED: list[dist.Work] = []


def _future(work: dist.Work) -> torch.futures.Future:
    """The work's future; gloo's send/recv/reduce_scatter works have none, so a thread watches those."""
    try:
        return work.get_future()
    except RuntimeError:
        fut: torch.futures.Future = torch.futures.Future()

        def watch() -> None:
            try:
                work.wait()
                fut.set_result(None)
            except Exception as e:  # noqa: BLE001  (handed to whoever waits)
                fut.set_exception(e)
        threading.Thread(target=watch, daemon=True, name="neuron-dist-watch").start()
        return fut


class Work(dist._Work):
    """A collective in flight: gloo's works plus a finishing step (AVG's division, unpacking) that runs once,
    in wait() or in the future's callback. wait() raises an error naming the collective; the future (made on
    request, by DDP and comm hooks) resolves to the caller's tensors. The group is held weakly: were gloo's
    thread to drop the last reference, the group's destructor would join that thread from itself."""

    def __init__(self, pg: ProcessGroupNeuron, name: str, works: Sequence[dist.Work], result: Any,
                 finish: Callable[[], None] | None = None, inputs: Any = ()):
        super().__init__()
        self._group, self._name, self._works, self._result = weakref.ref(pg), name, list(works), result
        self._inputs = inputs  # kept alive with the work
        self._finish, self._lock, self._fut = finish, threading.Lock(), None

    def _failure(self, err: BaseException) -> dist.DistBackendError:
        pg = self._group()
        return pg._failure(self._name, err) if pg else dist.DistBackendError(f"neuron: {self._name}: {err}")

    def _complete(self) -> None:
        with self._lock:
            finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            for w in self._works:
                w.wait()
        except Exception as e:
            raise self._failure(e) from e
        self._complete()
        return True

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            futs = [_future(w) for w in self._works]

            def done(_: torch.futures.Future) -> Any:
                try:
                    for f in futs:
                        f.wait()
                except Exception as e:
                    raise self._failure(e) from e
                self._complete()
                return self._result
            self._fut = torch.futures.collect_all(futs).then(done)
        return self._fut

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self.is_completed():
            return None
        try:
            self.wait()
            return None
        except Exception as e:  # noqa: BLE001
            return e

    def result(self) -> list[torch.Tensor]:
        return self._result

    def _source_rank(self) -> int:
        """The sender of a `recv` from any source (c10d reads it after wait())."""
        return self._works[0]._source_rank()


def _options(opts: Any, cls: type) -> Any:
    """Accept the options object c10d passes, None, or a bare ReduceOp (the older pybind overloads)."""
    if isinstance(opts, cls):
        return opts
    o = cls()
    if isinstance(opts, (ReduceOp, RedOpType)):
        o.reduceOp = ReduceOp(opts) if isinstance(opts, RedOpType) else opts
    return o


class ProcessGroupNeuron(dist.ProcessGroup):
    """c10d process group for `neuron` (and CPU) tensors: gloo on zero-copy host views.

    A Python ProcessGroup (the PyProcessGroup trampoline): torch.distributed's Python API calls these methods
    directly, and C++ callers (DDP's reducer, functional collectives, compiled graphs) reach them through the
    trampoline. The inner gloo backend is also registered for `neuron` and `cpu` so that introspection
    (`_get_backend`, `_device_types`, group names) behaves as for a built-in group.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 global_ranks: Sequence[int] = ()):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._timeout, self._global_ranks, self._seq = timeout, list(global_ranks) or list(range(size)), 0
        self._coalescing: list[Work] | None = None
        self._inflight: list[Work] = []
        self._held = HeldWorks()
        weakref.finalize(self, HeldWorks.release, self._held.works)
        for device in ("neuron", "cpu"):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, self._gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)

    @staticmethod
    def create(opts: Any, backend_options: Any = None) -> ProcessGroupNeuron:
        """The creator registered with `dist.Backend.register_backend(..., extended_api=True)`."""
        return ProcessGroupNeuron(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                                  opts.global_ranks_in_group)

    def getBackendName(self) -> str:
        return "neuron"

    def __repr__(self) -> str:
        return f"ProcessGroupNeuron(rank={self.rank()}, size={self.size()}, ranks={self._global_ranks})"

    # ---- agreement check and errors ----

    def _where(self) -> str:
        return (f"rank {self.rank()} of {self.size()} in group {self.group_name!r} "
                f"(global ranks {self._global_ranks}, timeout {self._timeout.total_seconds():g}s)")

    def _failure(self, name: str, err: BaseException) -> dist.DistBackendError:
        return dist.DistBackendError(
            f"neuron: {name} failed on {self._where()}: a peer process died, did not reach the collective "
            f"within the timeout, or the connection broke. gloo: {str(err).strip()}")

    def _agree(self, name: str, signature: Tensors = (), root: int = -1, redop: ReduceOp | None = None,
               send: Sequence[int] = (), recv: Sequence[int] = ()) -> None:
        """Exchange fingerprints so that every rank raises the same clear error if the ranks disagree."""
        self._seq += 1
        if not checks_enabled():
            return
        n = self.size()
        sig = [(tuple(t.shape), _DTYPES.index(t.dtype)) for t in signature]
        dims = sig[0][0] if sig else ()
        fp = Fingerprint(self._seq, OPS.index(name), root, -1 if redop is None else int(redop.op),
                         sig[0][1] if sig else -1, len(sig), sum(t.numel() for t in signature), hash(tuple(sig)),
                         len(dims), (*dims, *[-1] * _MAX_DIMS)[:_MAX_DIMS], tuple(send or [-1] * n),
                         tuple(recv or [-1] * n))
        row = fp.row()
        gathered = torch.empty(n * len(row), dtype=torch.int64)
        try:
            exchange = self._gloo._allgather_base(gathered, torch.tensor(row))
            self._held.add([exchange])
            exchange.wait()
        except Exception as e:
            raise self._failure(name, e) from e
        fps = [Fingerprint.from_row(r, n) for r in gathered.view(n, -1).tolist()]
        if all(f.same_call(fps[0]) for f in fps) and all(
                fps[i].send[j] == fps[j].recv[i] for i in range(n) for j in range(n)):
            return
        per_rank = "\n".join(f"  rank {r}: {f.describe()}" for r, f in enumerate(fps))
        raise RuntimeError(f"neuron: ranks disagree on collective #{self._seq} ({name} on this rank), "
                           f"{self._where()}:\n{per_rank}")

    def _run(self, name: str, launch: Callable[[], dist.Work | list[dist.Work]], result: Any,
             finish: Callable[[], None] | None = None, inputs: Any = ()) -> Work:
        """Start the gloo op(s) on host views; gloo's own argument errors propagate as raised. Host views do not
        own device memory, so the group keeps each Work, and with it the result and input tensors, until its
        transfer is done: neither the caller nor a compiled graph can free memory gloo still reads or writes."""
        works = launch()
        works = works if isinstance(works, list) else [works]
        self._held.add(works)
        work = Work(self, name, works, result, finish, inputs)
        self._inflight = [w for w in self._inflight if not w.is_completed()] + [work]
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    # ---- collectives (names and arguments as torch.distributed and the trampoline call them) ----

    def barrier(self, opts: Any = None) -> Work:
        self._agree("barrier")
        if checks_enabled():  # the fingerprint exchange already synchronised every rank
            return Work(self, "barrier", [], [])
        return self._run("barrier", lambda: self._gloo.barrier(_options(opts, c10d.BarrierOptions)), [])

    def _reduce_like(self, name: str, tensors: Tensors, opts: Any, call: Callable[[list, Any], Any],
                     root: int = -1) -> Work:
        red = _reduction(opts.reduceOp, self.size())
        self._agree(name, tensors, root, opts.reduceOp)
        if red.scale is not None:
            for t in tensors:
                t.mul_(red.scale)
        opts.reduceOp = red.op
        finish = functools.partial(_finish_reduction, name, tensors, red.divisor)
        return self._run(name, lambda: call(_views(tensors), opts), list(tensors), finish)

    def allreduce(self, tensors: Tensors, opts: Any = None) -> Work:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        return self._reduce_like("all_reduce", tensors, _options(opts, c10d.AllreduceOptions),
                                 self._gloo.allreduce)

    def allreduce_coalesced(self, tensors: Tensors, opts: Any = None) -> Work:
        opts = _options(opts, c10d.AllreduceCoalescedOptions)
        return self._reduce_like("all_reduce_coalesced", tensors, opts, self._gloo.allreduce_coalesced)

    def reduce(self, tensors: Tensors, opts: Any = None) -> Work:
        opts = _options(opts, c10d.ReduceOptions)
        return self._reduce_like("reduce", tensors, opts, self._gloo.reduce, opts.rootRank)

    def broadcast(self, tensors: Tensors, opts: Any = None) -> Work:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        opts = _options(opts, c10d.BroadcastOptions)
        self._agree("broadcast", tensors, opts.rootRank)
        return self._run("broadcast", lambda: self._gloo.broadcast(_views(tensors), opts), list(tensors))

    def allgather(self, outputs: Sequence[Tensors], inputs: Tensors, opts: Any = None) -> Work:
        self._agree("all_gather", inputs)
        return self._run("all_gather", lambda: self._gloo.allgather(
            [_views(o) for o in outputs], _views(inputs), _options(opts, c10d.AllgatherOptions)),
            [list(o) for o in outputs], inputs=inputs)

    def allgather_coalesced(self, outputs: Sequence[Tensors], inputs: Tensors, opts: Any = None) -> Work:
        self._agree("all_gather_coalesced", inputs)
        return self._run("all_gather_coalesced", lambda: self._gloo.allgather_coalesced(
            [_views(o) for o in outputs], _views(inputs), _options(opts, c10d.AllgatherOptions)),
            [list(o) for o in outputs], inputs=inputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        self._agree("all_gather_into_tensor", [input])
        return self._run("all_gather_into_tensor", lambda: self._gloo._allgather_base(
            _flat(output), _flat(input), _options(opts, c10d.AllgatherOptions)), [output], inputs=input)

    def all_gather_single_coalesced(self, outputs: Tensors, inputs: Tensors, opts: Any = None) -> Work:
        self._agree("all_gather_into_tensor_coalesced", inputs)
        opts = _options(opts, c10d.AllgatherOptions)
        return self._run("all_gather_into_tensor_coalesced", lambda: [
            self._gloo._allgather_base(_flat(o), _flat(i), opts) for o, i in zip(outputs, inputs, strict=True)],
            list(outputs), inputs=inputs)

    def _reduce_scatter(self, name: str, outputs: Tensors, inputs: Sequence[Tensors], opts: Any) -> Work:
        """gloo's reduce_scatter on lists; the tensor forms view their flat input as per-rank chunks."""
        red = _reduction(opts.reduceOp, self.size())
        self._agree(name, outputs, -1, opts.reduceOp)
        if red.scale is not None:  # never scale the caller's input in place
            inputs = [[i * red.scale for i in chunks] for chunks in inputs]
        opts.reduceOp = red.op
        finish = functools.partial(_finish_reduction, name, outputs, red.divisor)
        return self._run(name, lambda: [self._gloo.reduce_scatter([host_view(o)], [_views(chunks)], opts)
                                        for o, chunks in zip(outputs, inputs, strict=True)],
                         list(outputs), finish, inputs)

    def _chunks(self, output: torch.Tensor, input: torch.Tensor) -> list[torch.Tensor]:
        if input.numel() != output.numel() * self.size():
            raise ValueError(f"neuron: reduce_scatter_tensor needs an input of {self.size()} x the output's "
                             f"{output.numel()} elements, got {input.numel()}")
        return list(input.reshape(self.size(), *output.shape).unbind(0))

    def reduce_scatter(self, outputs: Tensors, inputs: Sequence[Tensors], opts: Any = None) -> Work:
        opts = _options(opts, c10d.ReduceScatterOptions)
        return self._reduce_scatter("reduce_scatter", outputs, inputs, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        return self._reduce_scatter("reduce_scatter_tensor", [output], [self._chunks(output, input)],
                                    _options(opts, c10d.ReduceScatterOptions))

    def reduce_scatter_single_coalesced(self, outputs: Tensors, inputs: Tensors, opts: Any = None) -> Work:
        return self._reduce_scatter("reduce_scatter_tensor_coalesced", outputs,
                                    [self._chunks(o, i) for o, i in zip(outputs, inputs, strict=True)],
                                    _options(opts, c10d.ReduceScatterOptions))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                          input_splits: Sequence[int], opts: Any = None) -> Work:
        n = self.size()

        def counts(t: torch.Tensor, splits: Sequence[int]) -> list[int]:
            row = t[0].numel() if t.dim() and len(t) else 0
            return [s * row for s in splits] if splits else [t.numel() // n] * n
        self._agree("all_to_all_single", send=counts(input, input_splits), recv=counts(output, output_splits))
        return self._run("all_to_all_single", lambda: self._gloo.alltoall_base(
            host_view(output), host_view(input), list(output_splits), list(input_splits),
            _options(opts, c10d.AllToAllOptions)), [output], inputs=input)

    def alltoall(self, outputs: Tensors, inputs: Tensors, opts: Any = None) -> Work:
        """gloo's list all_to_all needs equal sizes: pack into one uneven all_to_all_single, then unpack."""
        send, recv = [t.numel() for t in inputs], [t.numel() for t in outputs]
        self._agree("all_to_all", send=send, recv=recv)
        packed = torch.cat([host_view(t).reshape(-1) for t in inputs])
        unpacked = torch.empty(sum(recv), dtype=packed.dtype)

        def finish() -> None:
            for o, chunk in zip(outputs, unpacked.split(recv), strict=True):
                host_view(o).copy_(chunk.view(o.shape))
        return self._run("all_to_all", lambda: self._gloo.alltoall_base(
            unpacked, packed, recv, send, _options(opts, c10d.AllToAllOptions)), list(outputs), finish)

    def gather(self, outputs: Sequence[Tensors], inputs: Tensors, opts: Any = None) -> Work:
        opts = _options(opts, c10d.GatherOptions)
        self._agree("gather", inputs, opts.rootRank)
        return self._run("gather", lambda: self._gloo.gather(
            [_views(o) for o in outputs], _views(inputs), opts), [list(o) for o in outputs], inputs=inputs)

    def scatter(self, outputs: Tensors, inputs: Sequence[Tensors], opts: Any = None) -> Work:
        opts = _options(opts, c10d.ScatterOptions)
        self._agree("scatter", outputs, opts.rootRank)
        return self._run("scatter", lambda: self._gloo.scatter(
            _views(outputs), [_views(i) for i in inputs], opts), list(outputs), inputs=inputs)

    # point to point: nothing to agree on collectively; gloo matches them by peer and tag
    def send(self, tensors: Tensors, dst: int, tag: int = 0) -> Work:
        return self._run("send", lambda: self._gloo.send(_views(tensors), dst, tag), list(tensors))

    def recv(self, tensors: Tensors, src: int, tag: int = 0) -> Work:
        return self._run("recv", lambda: self._gloo.recv(_views(tensors), src, tag), list(tensors))

    def recv_anysource(self, tensors: Tensors, tag: int = 0) -> Work:
        return self._run("recv", lambda: self._gloo.recv_anysource(_views(tensors), tag), list(tensors))

    # old-style coalescing (`_coalescing_manager(group, device)`): ops run as issued, one Work waits for all
    def _start_coalescing(self, device: torch.device) -> None:
        self._coalescing = []

    def _end_coalescing(self, device: torch.device) -> Work:
        works, self._coalescing = self._coalescing or [], None
        return Work(self, "coalesced collectives", [g for w in works for g in w._works],
                    [t for w in works for t in w.result()], lambda: [w._complete() for w in works])

    # aliases under the older c10d method names
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single

