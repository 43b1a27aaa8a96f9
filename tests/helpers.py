"""Helpers shared by the test files, each defined once here.

Streams are held and observed without timing: `Gate` holds the current stream until the host opens it, `stamp`
records when the stream reached a point. Both are kernels queued with `_C._queue_kernel` (run by the stream's worker,
in stream order), and their times are `time.monotonic_ns()`, the clock of the device's events (CLOCK_MONOTONIC,
C++'s steady_clock), so a test can bound an event's elapsed time by what it knows ran between the records."""
from __future__ import annotations

import threading
import time
from typing import Any

import torch

import torchneuron


def _queue(name: str, run: Any) -> None:
    torchneuron._C._queue_kernel(torch.neuron.current_device(), name, run, 1, [], [])


class Gate:
    """A kernel on the current stream that waits until the host calls `open()`: work queued behind it cannot have
    run while it is closed, whatever the machine's load. `released` is whether the host opened it (False: it gave up
    after `timeout` seconds, so a launch that waits for queued work fails a test instead of hanging it);
    `started_ns`/`ended_ns`: when the stream's worker entered and left it. A context manager: it opens on exit.
    What is launched behind a closed gate must have run once before: the first call of an op signature runs on the
    host thread after the stream's queued work, so it would wait for the gate."""

    def __init__(self, timeout: float = 60.0) -> None:
        self._event = threading.Event()
        self.timeout = timeout
        self.released: bool | None = None
        self.started_ns: int | None = None
        self.ended_ns: int | None = None
        _queue("test-gate", self._hold)

    def _hold(self) -> None:
        self.started_ns = time.monotonic_ns()
        self.released = self._event.wait(self.timeout)  # releases the GIL while it waits
        self.ended_ns = time.monotonic_ns()

    def open(self) -> None:
        self._event.set()

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.open()


def stamp(into: list[int]) -> None:
    """Queue on the current stream a kernel appending the time the stream's worker reached it to `into`; under
    TORCHNEURON_LAUNCH_BLOCKING=1 it has run when this returns, as every kernel launched there (events recorded
    there take the time of their record)."""
    _queue("test-stamp", lambda: into.append(time.monotonic_ns()))
    if torchneuron._C._launch_blocking():
        torch.neuron.current_stream().synchronize()
