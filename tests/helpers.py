"""Helpers shared by the test files, each defined once here.

Streams are held and observed without timing: `Gate` holds the current stream until the host opens it, `stamp`
records when the stream reached a point. Both are kernels queued with `_C._queue_kernel` (run by the stream's worker,
in stream order). A stamp's time is `time.monotonic_ns()`, the clock of the device's events (CLOCK_MONOTONIC, C++'s
steady_clock), so a test can bound an event's elapsed time by what it knows ran between the records."""
from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

import torchneuron

# What configures the device (and the neuron tools): a child process under test starts without it.
DEVICE_PREFIXES = ("TORCHNEURON_", "NEURON_")


def clean_env(drop: tuple[str, ...] = (), **extra: Any) -> dict[str, str]:
    """This process's environment without the device's configuration (and variables starting with `drop`), plus
    `extra` (values as strings): what a child process under test starts with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(DEVICE_PREFIXES + drop)}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def to_cpu(x: Any) -> Any:
    """One value moved to the CPU: a neuron tensor (detached, keeping requires_grad), a neuron device or device
    string; anything else unchanged. For the CPU reference run of a sample."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().requires_grad_(x.requires_grad) if x.is_neuron else x
    if isinstance(x, torch.device) and x.type == "neuron":
        return torch.device("cpu")
    if isinstance(x, str) and x.startswith("neuron"):
        return "cpu"
    return x


def to_cpu_tree(x: Any) -> Any:
    """Results (any pytree: tuples, named tuples, lists, dicts) as detached CPU tensors, to compare with the CPU's;
    a tensor on another device than neuron or the CPU fails."""
    def cpu(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        assert t.device.type in ("neuron", "cpu"), t.device
        return t.detach().cpu()
    return torch.utils._pytree.tree_map(cpu, x)


def _queue(name: str, run: Any) -> None:
    torchneuron._C._queue_kernel(torch.neuron.current_device(), name, run, 1, [], [])


class Gate:
    """A kernel on the current stream that waits until the host calls `open()`: work queued behind it cannot have
    run while it is closed, whatever the machine's load. `released` is whether the host opened it (False: it gave up
    after `timeout` seconds, so a launch that waits for queued work fails a test instead of hanging it). A context
    manager: it opens on exit.
    What is launched behind a closed gate must have run once before: the first call of an op signature runs on the
    host thread after the stream's queued work, so it would wait for the gate."""

    def __init__(self, timeout: float = 60.0) -> None:
        self._event = threading.Event()
        self.timeout = timeout
        self.released: bool | None = None
        _queue("test-gate", self._hold)

    def _hold(self) -> None:
        self.released = self._event.wait(self.timeout)  # releases the GIL while it waits

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
