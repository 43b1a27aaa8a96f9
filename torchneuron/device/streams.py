"""Streams and events of `torch.neuron`, mirroring `torch.cuda`, on the C++ device guard.

The modelled device runs each op to completion when it is issued, in program order: any stream's work is done
when the issuing call returns, so waits never block and events time the work issued between them.
"""
from __future__ import annotations

from typing import Any

import torch

from .module import _checked, _device_t

PRIORITY_RANGE = (0, -1)  # (lowest, highest), as torch.cuda.Stream.priority_range(); lower is higher priority
_priorities: dict[tuple[int, int], int] = {}  # (device, stream id) -> priority, for streams made with one


class Stream(torch.Stream):
    """A neuron stream: `torch.neuron.Stream(device=None, priority=0)`, usable as a context manager.

    Priorities are clamped to PRIORITY_RANGE like CUDA's and reported by `.priority`; with every op complete when
    issued they order nothing.
    """

    def __new__(cls, device: _device_t = None, priority: int = 0, **kwargs: Any) -> Stream:
        if "stream_id" in kwargs:  # re-wrapping an existing stream
            return super().__new__(cls, **kwargs)
        priority = max(PRIORITY_RANGE[1], min(PRIORITY_RANGE[0], priority))
        s = super().__new__(cls, device=torch.device("neuron", _checked(device)), priority=priority)
        if priority:
            _priorities[s.device_index, s.stream_id] = priority
        return s

    @property
    def priority(self) -> int:
        return _priorities.get((self.device_index, self.stream_id), 0)

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return PRIORITY_RANGE

    def wait_event(self, event: torch.Event | Event) -> None:
        super().wait_event(_unwrap(event))

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event(device=self.device_index)
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<torch.neuron.Stream device=neuron:{self.device_index} stream_id={self.stream_id}>"


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


class Event:
    """A neuron event: `torch.neuron.Event(enable_timing=False, blocking=False, interprocess=False)`.

    It wraps a `torch.Event` (reachable as `.event`) because torch.Event's methods accept only exact
    torch.Event arguments, so a subclass could not be timed against another.
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 device: _device_t = None):
        self.event = torch.Event(device=torch.device("neuron", _checked(device)), enable_timing=enable_timing,
                                 blocking=blocking, interprocess=interprocess)

    def record(self, stream: torch.Stream | None = None) -> None:
        self.event.record(stream)

    def wait(self, stream: torch.Stream | None = None) -> None:
        self.event.wait(stream)

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    def elapsed_time(self, end_event: Event | torch.Event) -> float:
        """Milliseconds between this event's record and `end_event`'s."""
        return self.event.elapsed_time(_unwrap(end_event))

    @property
    def device(self) -> torch.device:
        return self.event.device

    def ipc_handle(self) -> bytes:
        """torch.cuda.Event's handle for another process: refused, as device memory is private to the process."""
        raise RuntimeError(_NO_IPC)

    @classmethod
    def from_ipc_handle(cls, device: _device_t, handle: bytes) -> Event:
        raise RuntimeError(_NO_IPC)

    def __repr__(self) -> str:
        return f"<torch.neuron.Event {self.event!r}>"


_NO_IPC = ("neuron events cannot be shared between processes (interprocess=True): device memory and its events "
           "are private to the process (docs/device.md, Between processes); synchronize in the producing process "
           "and send CPU tensors")


def _unwrap(event: Event | torch.Event) -> torch.Event:
    return event.event if isinstance(event, Event) else event


def current_stream(device: _device_t = None) -> Stream:
    return _wrap(torch.accelerator.current_stream(_checked(device)))


def default_stream(device: _device_t = None) -> Stream:
    s = torch.accelerator.current_stream(_checked(device))
    return Stream(stream_id=0, device_index=s.device_index, device_type=s.device_type)


def set_stream(stream: torch.Stream) -> None:
    if stream is not None:
        torch.accelerator.set_stream(stream)


class StreamContext:
    """Makes `stream` current on its device (and that device current) for the `with` block."""

    def __init__(self, stream: torch.Stream | None):
        self.stream = stream
        self.saved: tuple[torch.Stream, int] | None = None

    def __enter__(self) -> torch.Stream | None:
        if self.stream is not None:
            prev_dev = torch._C._accelerator_hooks_exchange_device(self.stream.device_index)
            self.saved = (torch.accelerator.current_stream(self.stream.device_index), prev_dev)
            torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: Any) -> bool:
        if self.saved is not None:
            torch.accelerator.set_stream(self.saved[0])
            torch._C._accelerator_hooks_set_current_device(self.saved[1])
        return False


def stream(stream: torch.Stream | None) -> StreamContext:
    return StreamContext(stream)


def wait_stream(stream: torch.Stream) -> None:
    current_stream(stream.device_index).wait_stream(stream)


def record_event(event: Event | None = None) -> Event:
    event = event or Event()
    event.record()
    return event


def wait_event(event: Event | torch.Event) -> None:
    event.wait()


def query() -> bool:
    return current_stream().query()
