"""The stream-hazard checker, `torch.neuron.stream_check` (TORCHNEURON_STREAM_CHECK=1): a tensor used on two streams
with no ordering edge between the uses is reported with both Python stacks.

It works on the program's logical order, never on timing, so it finds on this device the races that only show on
an asynchronous one (Trainium, a GPU). A dispatch mode sees every op on neuron tensors and takes its reads and
writes from the schema's alias annotations; the C++ guard and allocator report event record/wait, synchronisation
and allocation/free through c10's GPU trace (csrc/stream_trace.cpp), which PyTorch delivers to
`torch.neuron._gpu_trace`. Ordering is kept as vector clocks: each stream's clock says how far into every stream's
work it is ordered; an event record copies the recording stream's clock, a wait merges it in, a host
synchronisation merges into the host clock every later launch starts from.
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.optable import op_info

StreamKey = int  # (stream id << 8) | device index: csrc/stream_trace.cpp's stream_trace_key
Clock = dict[StreamKey, int]  # stream -> the last launch on it that this point is ordered after


def stream_key(s: torch.Stream) -> StreamKey:
    return (s.stream_id << 8) | s.device_index


HOST: StreamKey = -1  # the host's own accesses (CPU ops on the memory of a non-blocking copy)


def _stream_name(key: StreamKey) -> str:
    if key == HOST:
        return "the host"
    return f"stream {key >> 8} of neuron:{key & 0xFF}" + (" (the default stream)" if key >> 8 == 0 else "")


_TORCH = os.path.dirname(torch.__file__)
_MACHINERY = (__file__, os.path.join(_TORCH, "_compile.py"), os.path.join(_TORCH, "_dynamo", ""))  # mode plumbing


Stack = list[tuple[str, int, str, None]]  # (file, line, function, source): read only when a report prints it


def _stack() -> Stack:
    """The caller's Python stack, outermost first, without the checker's frames."""
    frames, f = [], sys._getframe(1)
    while f is not None:
        if not f.f_code.co_filename.startswith(_MACHINERY):
            frames.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name, None))
        f = f.f_back
    return frames[::-1]


def _format(stack: Stack) -> str:
    return "".join(traceback.StackSummary.from_list(stack).format())


class TensorInfo(NamedTuple):
    """What a report says of a tensor (kept as values: formatting each access would cost more than the check)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    data_ptr: int

    def __str__(self) -> str:
        return f"the tensor of shape {self.shape}, dtype {self.dtype}, data pointer {self.data_ptr:#x}"


Blocks = dict[int, TensorInfo]  # data pointer -> the tensor using it


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of an op argument or result: a tensor, or a (nested) list or tuple of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class Access(NamedTuple):
    kind: str  # "read" | "write"
    stream: StreamKey
    seq: int  # the launch's place in the program's order of launches
    op: str
    tensor: TensorInfo
    stack: Stack


class Hazard(NamedTuple):
    kind: str  # "read-after-write" | "write-after-read" | "write-after-write" | "free-without-record_stream"
    data_ptr: int
    current: Access
    earlier: Access

    def __str__(self) -> str:
        now, then = self.current, self.earlier
        if self.kind == "free-without-record_stream":
            head = (f"{self.kind}: {then.tensor} was freed on the host (its memory goes back to the allocator for "
                    f"reuse on {_stream_name(now.stream)}) while {_stream_name(then.stream)} may still be "
                    f"{ {'read': 'reading', 'write': 'writing'}[then.kind]} it in {then.op}, with no ordering edge "
                    f"in between. Call "
                    f"tensor.record_stream(that stream) after using it there, or order the streams (wait_stream, "
                    f"an Event, synchronize) before the free.")
        else:
            head = (f"{self.kind}: {now.op} {now.kind}s {now.tensor} on {_stream_name(now.stream)} while "
                    f"{then.op} on {_stream_name(then.stream)} {then.kind}s it, with no ordering edge between the "
                    f"two (Event record/wait, wait_stream, or a synchronize).")
        return (f"{head}\n\nThe {now.kind}{f' ({now.op})' if now.op else ''}, at:\n"
                f"{_format(now.stack)}\nThe earlier {then.kind} ({then.op}), at:\n{_format(then.stack)}")


class StreamHazardError(RuntimeError):
    """A tensor used on two streams without an ordering edge (torch.neuron.stream_check)."""

    def __init__(self, hazards: list[Hazard]):
        self.hazards = hazards
        super().__init__("torch.neuron.stream_check found an unsynchronised use of a tensor across streams:\n\n"
                         + "\n\n".join(map(str, hazards)))


@dataclass
class _Storage:
    """What has been done to one block of device memory since it was allocated."""
    alloc_stream: StreamKey
    write: Access | None = None
    reads: dict[StreamKey, Access] = field(default_factory=dict)  # since the write; the last one per stream
    recorded: set[StreamKey] = field(default_factory=set)  # Tensor.record_stream


def _merge(into: Clock, other: Clock) -> None:
    for s, n in other.items():
        if n > into.get(s, 0):
            into[s] = n


class Checker:
    """Vector clocks of the streams, events and host, and the accesses to each block of device memory."""

    def __init__(self) -> None:
        self.seq = 0
        self.host: Clock = {}
        self.streams: dict[StreamKey, Clock] = {}
        self.events: dict[int, Clock] = {}
        self.storages: dict[int, _Storage] = {}
        self.pending: list[Hazard] = []  # found in a trace callback, which cannot raise; raised at the next op
        self.host_blocks: dict[int, Access] = {}  # host memory a non-blocking copy's stream still uses

    def clock(self, s: StreamKey) -> Clock:
        """The stream's clock, with everything the host has synchronised with (later launches start after it)."""
        c = self.streams.setdefault(s, {})
        _merge(c, self.host)
        return c

    def ordered_before(self, a: Access, s: StreamKey) -> bool:
        return a.stream == s or self.clock(s).get(a.stream, 0) >= a.seq

    def launch(self, s: StreamKey, op: str, reads: Blocks, writes: Blocks,
               joined: list[StreamKey]) -> list[Hazard]:
        """An op on stream `s` reads and writes these blocks (data pointer -> tensor). A copy between
        devices is ordered on both devices' streams (`joined`), as CUDA's peer copies are."""
        for o in joined:
            _merge(self.clock(s), self.clock(o))
        self.seq += 1
        self.clock(s)[s] = self.seq
        for o in joined:
            _merge(self.clock(o), self.clock(s))
        stack, hazards = _stack(), []
        for ptr, desc in reads.items():
            st = self.storages.setdefault(ptr, _Storage(s))
            a = Access("read", s, self.seq, op, desc, stack)
            if st.write and not self.ordered_before(st.write, s):
                hazards.append(Hazard("read-after-write", ptr, a, st.write))
            st.reads[s] = a
        for ptr, desc in writes.items():
            st = self.storages.setdefault(ptr, _Storage(s))
            a = Access("write", s, self.seq, op, desc, stack)
            earlier = [r for r in st.reads.values() if not self.ordered_before(r, s)]
            hazards += [Hazard("write-after-read", ptr, a, r) for r in earlier]
            if not st.reads and st.write and not self.ordered_before(st.write, s):
                hazards.append(Hazard("write-after-write", ptr, a, st.write))
            st.write, st.reads = a, {}
        return hazards

    def host_use(self, by: StreamKey, op: str, reads: Blocks, writes: Blocks, copying: bool) -> list[Hazard]:
        """Host memory used by the host (`by` is HOST: a CPU op) or by a copy's stream; `copying`: a non-blocking
        copy, whose stream keeps using the memory after the call returns, until a synchronisation."""
        hazards = []
        for kind, blocks in (("read", reads), ("write", writes)):
            for ptr, info in blocks.items():
                a = Access(kind, by, self.seq, op, info, [])
                e = self.host_blocks.get(ptr)
                done = e is not None and (self.host.get(e.stream, 0) >= e.seq if by == HOST
                                          else self.ordered_before(e, by))
                hazard = e is not None and not done and "write" in (kind, e.kind)
                if hazard:
                    hazards.append(Hazard(f"{kind}-after-{e.kind}", ptr, a._replace(stack=_stack()), e))
                if copying:
                    self.host_blocks[ptr] = a._replace(stack=_stack())
                elif done or hazard:
                    del self.host_blocks[ptr]  # ordered now, or reported once
        return hazards

    def record_stream(self, ptr: int, s: StreamKey) -> None:
        if ptr in self.storages:
            self.storages[ptr].recorded.add(s)

    # -- the GPU trace (csrc/stream_trace.cpp) --
    def allocated(self, ptr: int) -> None:
        # the allocator serves the current stream of the current device (which the op's device guard has set)
        self.storages[ptr] = _Storage(stream_key(torch.accelerator.current_stream()))

    def freed(self, ptr: int) -> None:
        st = self.storages.pop(ptr, None)
        if st is None:
            return
        for a in ([st.write] if st.write else []) + list(st.reads.values()):
            if a.stream not in st.recorded and not self.ordered_before(a, st.alloc_stream):
                now = Access("free", st.alloc_stream, self.seq, "", a.tensor, _stack())
                self.pending.append(Hazard("free-without-record_stream", ptr, now, a))

    def event_created(self, event: int) -> None:
        self.events[event] = {}  # nothing recorded yet: waiting on it orders nothing

    def event_recorded(self, event: int, s: StreamKey) -> None:
        self.events[event] = dict(self.clock(s))

    def event_waited(self, event: int, s: StreamKey) -> None:
        _merge(self.clock(s), self.events.get(event, {}))

    def event_deleted(self, event: int) -> None:
        self.events.pop(event, None)

    def stream_synchronized(self, s: StreamKey) -> None:
        _merge(self.host, self.clock(s))

    def event_synchronized(self, event: int) -> None:
        _merge(self.host, self.events.get(event, {}))

    def device_synchronized(self) -> None:
        # c10's trace names no device: every stream counts as synchronised (it can only hide a hazard, never invent one)
        for s in list(self.streams):
            _merge(self.host, self.clock(s))


def _accesses(func: Any, args: tuple, kwargs: dict, out: Any, kind: str = "neuron") -> tuple[Blocks, Blocks, list[int]]:
    """The blocks of memory of device type `kind` an op reads and writes, from its schema's alias annotations, and
    their devices."""
    reads: Blocks = {}
    writes: Blocks = {}
    devices: dict[int, None] = {}  # in order, inputs first
    schema = func._schema
    metadata_only = schema.name.startswith("aten::new_") or schema.name.endswith("_like")  # factories read shapes
    undefined = "empty" in schema.name  # results with no defined contents: nothing is written yet

    def note(value: Any, write: bool, skip: bool) -> None:
        for t in _tensors(value):
            if t.device.type == kind:
                devices[t.device.index] = None
                ptr = t.untyped_storage().data_ptr()
                if ptr and not skip:
                    (writes if write else reads)[ptr] = TensorInfo(tuple(t.shape), t.dtype, ptr)

    named = {a.name: a for a in schema.arguments}
    bound = list(zip(schema.arguments, args, strict=False)) + [(named[k], v) for k, v in kwargs.items() if k in named]
    for arg, value in bound:
        alias = arg.alias_info
        note(value, bool(alias and alias.is_write), metadata_only or bool(alias and not alias.is_write))
    for ret, value in zip(schema.returns, out if isinstance(out, tuple) else (out,), strict=False):
        alias = ret.alias_info
        note(value, True, undefined or alias is not None)  # fresh results are written; aliases were counted
    for ptr in writes:
        reads.pop(ptr, None)
    return reads, writes, list(devices)


def _non_blocking(name: str, args: tuple, kwargs: dict) -> bool:
    return bool(kwargs.get("non_blocking") or (name == "aten::copy_" and len(args) > 2 and args[2]))


def _host_sync(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """The host waits for the op's stream: `.item()`, and a blocking copy between host and device."""
    name = func._schema.name
    if name == "aten::_local_scalar_dense":
        return True
    if not op_info(name).host_copy or _non_blocking(name, args, kwargs):
        return False
    return any(t.device.type == "cpu" for t in _tensors((args, tuple(kwargs.values()), out)))


class _Mode(TorchDispatchMode):
    def __init__(self, checker: Checker):
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.checker
        if c.pending:
            hazards, c.pending = c.pending, []
            raise StreamHazardError(hazards)
        if func._schema.name == "aten::record_stream":
            t, s = args
            if t.device.type == "neuron" and s.device.type == "neuron":
                c.record_stream(t.untyped_storage().data_ptr(), stream_key(s))
            return func(*args, **kwargs)
        device = next((t.device.index for t in _tensors((args, tuple(kwargs.values()))) if t.device.type == "neuron"),
                      None)
        s = stream_key(torch.accelerator.current_stream(device))
        out = func(*args, **kwargs)
        name = func._schema.name
        reads, writes, devices = _accesses(func, args, kwargs, out)
        hazards = []
        if devices:
            if device is None:  # a factory: its result's device, not the current one
                s = stream_key(torch.accelerator.current_stream(devices[0]))
            joined = [stream_key(torch.accelerator.current_stream(d)) for d in devices[1:]]
            hazards = c.launch(s, name, reads, writes, joined)
        copy = bool(devices) and op_info(name).host_copy
        copying = copy and _non_blocking(name, args, kwargs)
        if c.host_blocks or copying:  # host memory: a CPU op, or a copy's stream, using it
            hreads, hwrites, _ = _accesses(func, args, kwargs, out, "cpu")
            hazards += c.host_use(s if copy else HOST, name, hreads, hwrites, copying)
        if devices and _host_sync(func, args, kwargs, out):
            c.stream_synchronized(s)
        if hazards:
            raise StreamHazardError(hazards)
        return out


_active: _Mode | None = None


def _on(method: str):
    """A trace callback: calls the active checker's `method`, or does nothing when checking is off."""
    def fire_callbacks(*args: int) -> None:
        if _active is not None:
            getattr(_active.checker, method)(*args)
    return SimpleNamespace(fire_callbacks=fire_callbacks)


# PyTorch delivers the device's GPU trace to torch.neuron._gpu_trace.<registry>.fire_callbacks (the names of
# torch.cuda._gpu_trace); torch.neuron's __getattr__ serves this.
_gpu_trace = SimpleNamespace(
    EventCreationCallbacks=_on("event_created"),
    EventDeletionCallbacks=_on("event_deleted"),
    EventRecordCallbacks=_on("event_recorded"),
    EventWaitCallbacks=_on("event_waited"),
    MemoryAllocationCallbacks=_on("allocated"),
    MemoryDeallocationCallbacks=_on("freed"),
    StreamCreationCallbacks=_on("clock"),
    DeviceSynchronizationCallbacks=_on("device_synchronized"),
    StreamSynchronizationCallbacks=_on("stream_synchronized"),
    EventSynchronizationCallbacks=_on("event_synchronized"),
)


def is_enabled() -> bool:
    return _active is not None


def _activate(mode: _Mode | None) -> None:
    """Make `mode` the checker (its dispatch mode entered, the C++ trace on), or none (the trace off)."""
    global _active
    if _active is not None:
        _active.__exit__(None, None, None)
    _active = mode
    torch._C._activate_gpu_trace()  # PyTorch's switch, on for the rest of the process; ours follows the checker
    torch.ops.torchneuron._stream_trace(mode is not None)
    if mode is not None:
        mode.__enter__()


def enable() -> None:
    """Check every op of this thread from now on (a hazard raises StreamHazardError). A no-op if already on."""
    if _active is None:
        _activate(_Mode(Checker()))


def disable() -> None:
    """Stop checking; a hazard found at a free since the last op is raised here."""
    mode = _active
    if mode is not None:
        _activate(None)
        if mode.checker.pending:
            raise StreamHazardError(mode.checker.pending)


@contextlib.contextmanager
def checking() -> Iterator[Checker]:
    """`with torch.neuron.stream_check.checking():` checks the block with a fresh checker (a checker already on,
    e.g. from TORCHNEURON_STREAM_CHECK, pauses for the block and resumes after it)."""
    outer, mode = _active, _Mode(Checker())
    _activate(mode)
    try:
        yield mode.checker
    finally:
        try:
            disable()
        finally:
            if outer is not None:
                _activate(outer)
