"""`@nki.jit` kernels: calling one on CPU tensors / NumPy arrays (interpreted on the host), on `neuron` tensors
(queued on the device's current stream like any device kernel), over an SPMD launch grid (`kernel[g0, g1]`), or
for its cost only (`kernel.estimate`). Every call leaves its modelled per-engine timeline in `kernel.last_profile`.

On `neuron` tensors the kernel's HBM arguments are zero-copy host views of the device memory (the same mechanism as
compiled kernels, `_C._host_args`). A signature's first call runs now, after the stream's queued work, so a
hardware-rule error is raised at the call; it learns the output shapes. Later calls allocate the outputs on the
device and queue the interpreter on the stream; the call returns at once."""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import core, isa
from . import language as _language  # noqa: F401  (hands core and ops their instructions before a kernel runs)
from .core import NkiTensor
from .cost import KernelProfile, Timeline


def _default_chip() -> str:
    """The chip a kernel without an explicit target models: AWS's NEURON_PLATFORM_TARGET_OVERRIDE when set, else
    the configured instance's, else trn2."""
    from ..hardware import config

    if config.current_or_none() is None:
        return "trn2"
    cfg = config.current()  # at-use settings follow their variables (an invalid override: ConfigError)
    if cfg.nki_platform:
        return cfg.nki_platform
    return next(k for k, c in core.CHIPS.items() if c is cfg.chip)


# Called for each kernel call on `neuron` tensors: (kernel name, its modelled profile, device inputs, device
# results, host start ns, host ns). Filled by torchneuron.profiler.profile while it records.
OBSERVERS: list[Callable[[str, KernelProfile, list, list, int, int], None]] = []


@dataclass
class CallStats:
    """Calls of one kernel on `neuron` in this process, for the porting report: the modelled time of its last
    signature's timeline, its bottleneck engine and that engine's utilisation."""

    calls: int = 0
    modelled_s: float = 0.0  # summed over the calls
    bottleneck: str = ""
    utilisation: float = 0.0


CALLS: dict[str, CallStats] = {}


class _Mode(threading.local):
    shapes_only: bool = False  # set while a fake (meta) function learns a kernel's output shapes


MODE = _Mode()


def _to_host_tensor(a: Any) -> Any:
    if isinstance(a, core.HostCast):
        return a.to_tensor()
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else a


class Kernel:
    """An NKI kernel (the function decorated by `@nki.jit`)."""

    def __init__(self, fn: Callable[..., Any], target: str | None = None, stochastic_rounding: bool = False,
                 grid: tuple[int, ...] = ()):
        self.fn, self.target, self.stochastic_rounding, self.grid = fn, target, stochastic_rounding, grid
        self.last_profile: KernelProfile | None = None
        self.parent: Kernel | None = None  # the kernel a grid launch (`kernel[g]`) was made from
        self._specs: dict[tuple, tuple[bool, list[tuple[tuple[int, ...], torch.dtype]]]] = {}
        self._profiles: dict[tuple, KernelProfile] = {}  # per signature: a timeline does not depend on values
        functools.update_wrapper(self, fn)

    @property
    def name(self) -> str:
        return self.fn.__name__

    def __getitem__(self, grid: Any) -> Kernel:
        """`kernel[g0, g1]`: the same kernel launched over an SPMD grid of programs."""
        grid = tuple(int(g) for g in (grid if isinstance(grid, tuple | list) else (grid,)))
        if any(g < 1 for g in grid):
            raise ValueError(f"NKI kernel {self.name!r}: launch grid {list(grid)} has an axis without programs; "
                             "each axis needs at least 1")
        k = type(self)(self.fn, self.target, self.stochastic_rounding, grid)
        k._specs, k._profiles = self._specs, self._profiles
        k.parent = self
        return k

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if core.CURRENT.run is not None:  # a kernel called from a kernel (`@nki.jit(mode="trace")` helpers): inline
            return self.fn(*args, **kwargs)
        if torch.compiler.is_compiling():  # traced by Dynamo: run it as an opaque call (a graph break)
            return _opaque()(self, args, kwargs)
        return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if any(isinstance(a, torch.Tensor) and a.device.type == "neuron" for a in (*args, *kwargs.values())):
            return self._device_call(args, kwargs)
        return self.run(args, kwargs, compute=not MODE.shapes_only)

    # ---- host execution
    def run(self, args: tuple, kwargs: dict, compute: bool = True, target: str | None = None) -> Any:
        """Interpret the kernel on host tensors (CPU torch tensors or NumPy arrays)."""
        chip = core.chip_named(target or self.target or _default_chip())
        # NumPy arrays out for NumPy arrays in, or when no tensor came in at all (AWS's simulator is NumPy's)
        numpy_in = any(isinstance(a, np.ndarray) for a in args) or not any(isinstance(a, torch.Tensor) for a in args)
        timeline = Timeline(chip, self.name)
        outer = core.CURRENT.run
        grid = self.grid or (1,)
        shared = core.SharedHbm()
        result = None
        try:
            for program in _programs(grid):
                run = core.Run(self.name, chip, compute=compute, stochastic_rounding=self.stochastic_rounding,
                               grid=self.grid, program=program if self.grid else (), timeline=timeline,
                               shared=shared)
                shared.next = 0
                core.CURRENT.run = run
                isa.reset()  # no mask left over from a failed call
                nki_args = [self._argument(a, i) for i, a in enumerate(args)]
                nki_kwargs = {k: self._argument(v, k) for k, v in kwargs.items()}  # tensors passed by name too
                result = self.fn(*nki_args, **nki_kwargs)
                del nki_args, nki_kwargs
        finally:
            core.CURRENT.run = outer
        profile = timeline.profile()
        self.last_profile = profile
        if self.parent is not None:
            self.parent.last_profile = profile
        return _outputs(result, numpy_in)

    def _argument(self, a: Any, i: int | str) -> Any:
        a = _to_host_tensor(a)
        if not isinstance(a, torch.Tensor):
            return a
        core.check_dtype(a.dtype, f"argument {i} of {self.name}")
        alloc = core.Allocation(a, core.HBM, None, initialised=True)
        return NkiTensor(alloc, a, tuple((d, 0, 1, s) for d, s in enumerate(a.shape)), 0)

    def estimate(self, *args: Any, target: str | None = None, **kwargs: Any) -> KernelProfile:
        """The modelled cost of a call without computing values: tensors, or (shape, dtype) pairs, as arguments."""
        host = [torch.empty(a[0], dtype=a[1]) if isinstance(a, tuple) and len(a) == 2 and
                isinstance(a[1], torch.dtype) else a for a in args]
        self.run(tuple(host), kwargs, compute=False, target=target)
        return self.last_profile

    # ---- device execution
    def _device_call(self, args: tuple, kwargs: dict) -> Any:
        start = time.perf_counter_ns()
        results, seq, key = self._device_run(args, kwargs)
        profile = self._profiles[key]
        stats = CALLS.setdefault(self.name, CallStats())
        stats.calls += 1
        stats.modelled_s += profile.latency_s
        stats.bottleneck = profile.bottleneck
        stats.utilisation = profile.utilisation.get(profile.bottleneck, 0.0)
        if OBSERVERS:
            host = time.perf_counter_ns() - start
            ins = [a for a in args if isinstance(a, torch.Tensor)]
            for observe in OBSERVERS:
                observe(self.name, self._profiles[key], ins, results, start, host)
        return tuple(results) if seq else results[0]

    def _device_run(self, args: tuple, kwargs: dict) -> tuple[list, bool, tuple]:
        from .. import _C

        # tensors passed by name go through the same host views as positional ones
        names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        flat = list(args) + [kwargs[k] for k in names]
        device = next(a.device for a in flat if isinstance(a, torch.Tensor) and a.device.type == "neuron")
        dev_idx = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        for i in dev_idx:
            if flat[i].device != device:
                what = f"argument {i}" if i < len(args) else f"argument {names[i - len(args)]!r}"
                raise RuntimeError(f"NKI kernel {self.name}: expected all tensors on {device}, {what} is on "
                                   f"{flat[i].device}")
        key = (self.grid, *_signature(args, kwargs))

        def split(host: list) -> tuple[tuple, dict]:
            return tuple(host[:len(args)]), {**kwargs, **dict(zip(names, host[len(args):], strict=True))}

        if key not in self._specs or _C._launch_blocking():
            host = list(flat)
            _C._host_args(host, dev_idx)  # after the stream's queued work
            outs = self.run(*split(host))
            self._specs[key], self._profiles[key] = _spec(outs), self.last_profile
            results = [torch.empty(o.shape, dtype=o.dtype, device=device) for o in _flat(outs)]
            views = list(results)
            _C._host_args(views, list(range(len(views))), wait=False)
            for v, o in zip(views, _flat(outs), strict=True):
                v.copy_(o)
            return results, self._specs[key][0], key
        seq, specs = self._specs[key]
        results = [torch.empty(s, dtype=d, device=device) for s, d in specs]
        host, views = list(flat), list(results)
        keep = [flat[i] for i in dev_idx]
        _C._host_args(host, dev_idx, wait=False)
        _C._host_args(views, list(range(len(views))), wait=False)
        host_args, host_kwargs = split(host)
        _C._queue_kernel(device.index, f"nki:{self.name}",
                         functools.partial(self._replay, host_args, host_kwargs, views, keep, results), 1, keep,
                         results)
        self.last_profile = self._profiles[key]
        if self.parent is not None:
            self.parent.last_profile = self.last_profile
        return results, seq, key

    def _replay(self, host: tuple, kwargs: dict, views: list, *_keep: Any) -> None:
        outs = _flat(self.run(host, kwargs))
        for v, o in zip(views, outs, strict=True):
            v.copy_(o)


_OPAQUE: list[Callable[..., Any]] = []


def _opaque() -> Callable[..., Any]:
    """Kernel._call hidden from Dynamo (made at the first compiled call: Dynamo is loaded by then). Inside
    torch.compile, `nki_op` makes a kernel one graph node instead."""
    if not _OPAQUE:
        import torch._dynamo

        _OPAQUE.append(torch._dynamo.disable(lambda k, args, kwargs: k._call(args, kwargs),
                                             reason="an NKI kernel called directly (register it with nki_op)"))
    return _OPAQUE[0]


def _programs(grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for g in grid:
        out = [p + (i,) for p in out for i in range(g)]
    return out


def _signature(args: tuple, kwargs: dict) -> tuple:
    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), a.dtype)
        return ("V", repr(a))
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _flat(result: Any) -> list:
    if result is None:
        return []
    if isinstance(result, tuple | list):
        return [x for r in result for x in _flat(r)]
    return [result]


def _outputs(result: Any, numpy_out: bool) -> Any:
    if isinstance(result, tuple | list):
        return type(result)(_outputs(r, numpy_out) for r in result)
    if isinstance(result, NkiTensor):
        t = result.data
        if numpy_out:
            return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
        return t
    return result


def _spec(outs: Any) -> tuple[bool, list[tuple[tuple[int, ...], torch.dtype]]]:
    return isinstance(outs, tuple | list), [(tuple(o.shape), o.dtype) for o in _flat(outs)]


def jit(fn: Callable[..., Any] | None = None, *, target: str | None = None, platform_target: str | None = None,
        stochastic_rounding: bool = False, mode: str | None = None, **_: Any) -> Any:
    """`@nki.jit`: make `fn` an NKI kernel. target / platform_target: the modelled chip ("trn1", "trn2", "trn3";
    default: the configured instance's); stochastic_rounding: round float32 results into bf16/fp16/fp8
    stochastically instead of to nearest even."""
    def wrap(f: Callable[..., Any]) -> Kernel:
        f = f.fn if isinstance(f, Kernel) else f  # nki.baremetal(an @nki.jit kernel)
        return Kernel(f, target or platform_target, stochastic_rounding)
    return wrap(fn) if fn is not None else wrap


def simulate(kernel: Any) -> Callable[..., Any]:
    """`nki.simulate(kernel)(*arrays)`: run a kernel on host arrays (NumPy or CPU tensors)."""
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    return lambda *args, **kwargs: k.run(args, kwargs)


def simulate_kernel(kernel: Any, *args: Any, **kwargs: Any) -> Any:
    """`nki.simulate_kernel(kernel[grid], *arrays)`: the earlier API's simulator call; the results as arrays."""
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    return k.run(args, kwargs)


@dataclass(frozen=True)
class LatencyStats:
    """`benchmark_result.nc_latency`: the modelled latency in microseconds. The timeline is deterministic, so
    every percentile is the same number (on hardware they spread over the benchmark's iterations)."""

    latency_us: float

    def get_latency_percentile(self, percentile: float) -> float:
        return self.latency_us


@dataclass(frozen=True)
class BenchmarkResult:
    nc_latency: LatencyStats


class Benchmark(Kernel):
    """A kernel decorated by `nki.benchmark`: a call prices it (the modelled timeline, values not computed) and
    leaves `benchmark_result.nc_latency`; it returns nothing, as AWS's benchmark runs the compiled kernel for its
    latency only."""

    benchmark_result: BenchmarkResult | None = None

    def _call(self, args: tuple, kwargs: dict) -> Any:
        host = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
        self.run(host, kwargs, compute=False)
        result = BenchmarkResult(LatencyStats(self.last_profile.latency_s * 1e6))
        self.benchmark_result = result
        if self.parent is not None:
            self.parent.benchmark_result = result
        return None


def benchmark(kernel: Any = None, *, warmup: int = 0, iters: int = 1, target: str | None = None,
              platform_target: str | None = None, **_: Any) -> Any:
    """`nki.benchmark(warmup=, iters=, save_neff_name=...)`: a kernel whose calls report its modelled latency
    (`benchmark_result.nc_latency.get_latency_percentile(p)`, microseconds) instead of computing values; the
    NEFF/trace file arguments are accepted and ignored."""
    def wrap(f: Any) -> Benchmark:
        f = f.fn if isinstance(f, Kernel) else f
        return Benchmark(f, target or platform_target)
    return wrap(kernel) if kernel is not None else wrap


def profile(kernel: Any = None, *, target: str | None = None, platform_target: str | None = None,
            **_: Any) -> Any:
    """`nki.profile(working_directory=..., save_trace_name=...)`: runs the kernel; its modelled timeline is
    `kernel.last_profile` (`chrome_trace()` for a trace viewer). No NEFF/NTFF files are written."""
    def wrap(f: Any) -> Kernel:
        f = f.fn if isinstance(f, Kernel) else f
        return Kernel(f, target or platform_target)
    return wrap(kernel) if kernel is not None else wrap
