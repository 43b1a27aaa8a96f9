"""Timing helpers shared by the benchmarks: A/B runs taking turns (in two processes, or in one), medians of repeats."""
from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from collections.abc import Callable

import torch

# Optimizers are built with foreach=True on both sides. By default PyTorch picks the multi-tensor (foreach)
# implementation only on devices listed as supporting it, which includes every PrivateUse1 backend and not the
# CPU: the default would time a different optimizer algorithm on each side (it made `neuron` look ~20% faster).
FOREACH = True


def sync() -> None:
    """Wait for the device's queued work. A launch on an asynchronous device returns once the kernel is queued, so
    a timer stopped without this measures the launches, not the work, and the device looks faster than it is."""
    torch.accelerator.synchronize()


def warm_up(fn: Callable[[], object], times: int, most: int = 20) -> None:
    """Call `fn` at least `times` times, each followed by a synchronize and by the fusion compiles it started (eager
    fusion compiles a hot group off the stream and runs it unfused until its kernel is ready), and then until a call
    sights no group that is not compiled yet (at most `most` more): the run of queued ops that forms a group can
    change once other groups run fused, and a compile left for the timed repeats would take a core from both sides.
    What is timed afterwards is the steady state, never a compile."""
    from torchneuron.compiler import eager_fusion

    def unsettled() -> int:
        s = eager_fusion.stats()
        return s.cold + s.compiled + s.failures

    for n in range(times + most):
        before = unsettled()
        fn()
        sync()
        eager_fusion.wait_compiles()
        if n + 1 >= times and unsettled() == before:
            return


def interleaved(fns: dict[str, Callable[[], object]], calls: int, repeats: int = 9, warmup: int = 3
                ) -> dict[str, float]:
    """Median seconds per call of each function; the functions alternate (and swap order) every repeat, so a
    noisy neighbour on the shared machine hits all of them alike. Every timed block (and the warmup) ends with a
    device synchronize, for every function alike (on the CPU's it waits for nothing): without it an asynchronous
    device would be timed on the launches of its work only."""
    for fn in fns.values():
        warm_up(fn, warmup)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn = fns[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            samples[name].append((time.perf_counter() - t0) / calls)
    return {k: statistics.median(v) for k, v in samples.items()}


def _serve(conn, threads: int, build: Callable[..., Callable[[], object]], kwargs: dict, warmup: int) -> None:
    """One side of `paired`: build the function, then time `calls` calls (ending with a synchronize) per request."""
    torch.set_num_threads(threads)
    fn = build(**kwargs)
    warm_up(fn, warmup)
    conn.send("ready")
    while (calls := conn.recv()) is not None:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        conn.send((time.perf_counter() - t0) / calls)


def paired(build: Callable[..., Callable[[], object]], calls: int, repeats: int = 9, warmup: int = 3,
           min_turn: float = 0.3, **kwargs: object) -> dict[str, float]:
    """Median seconds per call of `build(device=d, **kwargs)()` on "neuron" and on "cpu", each side in its own
    process at this process's thread count, taking turns as `interleaved` does (only one side runs at a time, so a
    noisy neighbour still hits both alike). Separate processes because one process is not neutral ground: the
    device's stream worker has an OpenMP team of its own, and with more OpenMP threads in a process than cores,
    libgomp makes every team sleep between parallel regions instead of spinning (measured: the CPU's MLP step at 2
    threads took 4.9 ms beside a neuron worker's team, 2.1 ms in a process of its own).

    A turn is at least `calls` calls and lasts at least `min_turn` seconds on the slower side (both sides make the
    same number of calls): the first calls after the pause between turns run on cores that went idle (measured: an
    MLP step took 4.5 ms right after the pause and ~2.4 ms from the tenth on, on both sides), and a short turn
    would weigh that ramp rather than the steady state a training loop runs in."""
    ctx = multiprocessing.get_context("spawn")
    sides = {}
    for device in ("neuron", "cpu"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, torch.get_num_threads(), build,
                                                {**kwargs, "device": device}, warmup), daemon=True)
        proc.start()
        sides[device] = (parent, proc)
    try:
        for device, (conn, proc) in sides.items():
            try:
                conn.recv()
            except EOFError:
                proc.join(60)
                raise RuntimeError(f"the {device} side of the benchmark failed (exit code {proc.exitcode}); its "
                                   "traceback is above") from None
        probe = []
        for conn, _ in sides.values():  # one turn each at `calls`: the per-call time the turn length follows from
            conn.send(calls)
            probe.append(conn.recv())
        calls = max(calls, math.ceil(min_turn / max(probe)))
        samples: dict[str, list[float]] = {d: [] for d in sides}
        names = list(sides)
        for r in range(repeats):
            for device in (names if r % 2 == 0 else names[::-1]):
                conn = sides[device][0]
                time.sleep(0.05)  # the other side's OpenMP threads spin a few ms after its last parallel region
                conn.send(calls)
                samples[device].append(conn.recv())
        return {d: statistics.median(v) for d, v in samples.items()}
    finally:
        for conn, proc in sides.values():
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def _first_calls(conn, threads: int, build: Callable[..., Callable[[], object]], kwargs: dict, calls: int) -> None:
    """One side of `first_calls`: build, make `calls` calls, synchronize; send the seconds that took. Dynamo is
    imported first: `torch.optim`'s optimizers import it lazily (1-2.5 s here, on either side alike), which would
    otherwise be most of what is timed."""
    import torch._dynamo  # noqa: F401

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    fn = build(**kwargs)
    for _ in range(calls):
        fn()
    sync()
    conn.send(time.perf_counter() - t0)
    if kwargs["device"] == "neuron":  # the compiles it started finish (and fill the cache) before the next run
        from torchneuron.compiler import eager_fusion
        eager_fusion.wait_compiles()


def first_calls(build: Callable[..., Callable[[], object]], calls: int, cache_dir: Callable[[], str],
                repeats: int = 3, **kwargs: object) -> dict[str, float]:
    """Median seconds from building `build(device=d, **kwargs)` to the end of its `calls`-th call, on "neuron" and on
    "cpu", each run in a fresh process (spawned with TORCHNEURON_CACHE_DIR=`cache_dir()`), the sides taking turns:
    the start-up a user waits for (first-call work, fusion compiles started in the background) rather than the
    steady state `paired` measures. The processes' imports (Dynamo's too) are not timed."""
    from torchneuron.hardware.config import scoped_env

    ctx = multiprocessing.get_context("spawn")
    samples: dict[str, list[float]] = {"neuron": [], "cpu": []}
    for r in range(repeats):
        for device in (("neuron", "cpu") if r % 2 == 0 else ("cpu", "neuron")):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_first_calls, args=(child, torch.get_num_threads(), build,
                                                          {**kwargs, "device": device}, calls), daemon=True)
            with scoped_env("TORCHNEURON_CACHE_DIR", cache_dir()):
                proc.start()
            child.close()  # the child's end lives in the child only: its death ends `recv` with EOFError
            try:
                samples[device].append(parent.recv())
            except EOFError:
                raise RuntimeError(f"the {device} side of the benchmark failed (exit code {proc.exitcode}); its "
                                   "traceback is above") from None
            finally:
                proc.join(600)
    return {d: statistics.median(v) for d, v in samples.items()}


def row(name: str, neuron: float, cpu: float, unit: str, target: float | None = None) -> dict:
    return {"name": name, "neuron": neuron, "cpu": cpu, "ratio": neuron / cpu, "unit": unit,
            "threads": torch.get_num_threads(), "target": target}
