"""Device kernels: code generation for the host by Inductor's CPU backend, and the zero-copy device boundary.

A kernel's graph is rewritten from `neuron` to `cpu` and compiled by `compile_fx_inner`, exactly as Inductor
compiles a CPU graph. At run time its neuron inputs enter as CPU views of the same memory (no copy). Its first call
runs on the host thread, after the stream's queued work: the memory of its results is adopted by the neuron allocator
(no copy; counted by torch.neuron.memory_allocated()) and where each result lives is learnt (`Layout`). Later calls
are queued on the current stream like any device kernel: the results are allocated at the launch and the generated
code, run by the stream's worker, allocates those buffers in that memory, so the host runs ahead past the graph."""
from __future__ import annotations

import functools
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .. import _C
from ..runtime.tracking import KERNEL_OBSERVERS
from .cache import Cache, digest
from .inductor import build, kernel_codegen, target

CPU = torch.device("cpu")
_DEVICE_STR = re.compile(r"neuron(:\d+)?")


def _on_host(a: Any) -> Any:
    if isinstance(a, torch.device) and a.type == "neuron":
        return CPU
    if isinstance(a, str) and _DEVICE_STR.fullmatch(a):
        return "cpu"
    return a


def to_host(gm: fx.GraphModule, example_inputs: list) -> list:
    """Rewrite the graph (in place) to run on the host; returns CPU example inputs with the same metadata.

    Meta values are translated, not recomputed: a saved activation may arrive with the strides the forward
    kernel gave it, on which the graph's own view ops would not trace. Fake tensors that shared a storage
    still share one (Inductor's alias analysis reads it)."""
    from torch._guards import detect_fake_mode
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._pytree import tree_map

    fake_mode = detect_fake_mode(example_inputs)
    bases: dict[StorageWeakRef, torch.Tensor] = {}

    def cpu(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.device.type != "neuron":
            return v
        storage = v.untyped_storage()
        base = bases.get(key := StorageWeakRef(storage))
        if base is None:
            base = bases[key] = torch.empty(storage.nbytes(), dtype=torch.uint8, device=CPU)
        return torch.empty(0, dtype=v.dtype, device=CPU).set_(base.untyped_storage(), v.storage_offset(),
                                                               v.shape, v.stride())

    with fake_mode:
        inputs = [cpu(x) for x in example_inputs]
        placeholders = iter(inputs)
        for m in gm.modules():
            if not isinstance(m, fx.GraphModule):
                continue
            for n in m.graph.nodes:
                n.args = fx.node.map_aggregate(n.args, _on_host)
                n.kwargs = fx.node.map_aggregate(n.kwargs, _on_host)
                if "val" in n.meta:
                    n.meta["val"] = next(placeholders) if m is gm and n.op == "placeholder" else tree_map(
                        cpu, n.meta["val"])
            m.recompile()
    return inputs


def signature(inputs: list) -> list:
    return [(tuple(x.shape), tuple(x.stride()), str(x.dtype), str(x.device)) if isinstance(x, torch.Tensor)
            else repr(x) for x in inputs]


# The buffers of the generated code: its `empty_strided_cpu` is `_allocate`, which serves them from the plan of the
# call running on this thread (first call: record them; queued calls: the results' memory), or allocates.
_ALLOCATION = threading.local()


def _allocate(sizes: tuple, strides: tuple, dtype: torch.dtype) -> torch.Tensor:
    plan = getattr(_ALLOCATION, "plan", None)
    return _EMPTY_STRIDED_CPU(sizes, strides, dtype) if plan is None else plan(tuple(sizes), tuple(strides), dtype)


_EMPTY_STRIDED_CPU = torch._C._dynamo.guards._empty_strided_cpu
# Compiled calls are queued only when their threads leave a core to the host thread. Their generated code is Python
# (the GIL) and its loops run with every thread they were generated for: with every core busy, a worker running them
# competes with the host for cores and the GIL (small-GPT compiled step at 2 threads on 2 cores: 17 ms queued, 8 ms
# on the host thread; at 1 thread the same either way), so there they run on the host thread after the stream's work.
_CORES = os.cpu_count() or 1
# A queued call's size for the C++ core's kernel_threads(): large, so it runs with the launching thread's count, as
# its first call on that thread did (its loops were generated for that count; its ATen calls split work by it).
FULL_THREADS = 1 << 62


@dataclass(frozen=True)
class Buffer:
    """One allocation of the generated code, in the order it makes them (straight-line code: always the same)."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Layout:
    """Where a queued call's results live: `results` (the C++ core's result layout, learnt as an op's first call's
    is: each result over an input or over a fresh storage) and, for the generated code, its allocations in order and
    the fresh storage each buffer that holds results is allocated in. A fresh storage no buffer maps to is memory an
    ATen kernel inside the code allocated (an extern matmul's result): its results are copied there."""

    results: _C.ResultLayout
    buffers: tuple[Buffer, ...]
    roots: dict[int, int]  # buffer index -> the fresh storage (group) it is allocated in
    copies: frozenset[int]  # the results copied into their storage


class _Record:
    """The first call's allocations, and the address of each (no reference: the boundary adopts a result's memory
    only when the results alone hold it)."""

    def __init__(self) -> None:
        self.buffers: list[tuple[Buffer, int]] = []

    def __call__(self, sizes: tuple, strides: tuple, dtype: torch.dtype) -> torch.Tensor:
        t = _EMPTY_STRIDED_CPU(sizes, strides, dtype)
        self.buffers.append((Buffer(sizes, strides, dtype), t.data_ptr() if t.numel() else 0))
        return t


def _base(t: torch.Tensor) -> int:
    """The address of a tensor's storage. (Not through `untyped_storage()`: a storage's Python object, once made,
    holds a reference the boundary would take for a second holder of the memory.)"""
    return t.data_ptr() - t.storage_offset() * t.element_size() if t.numel() else 0


class _Replay:
    """A queued call's allocations: the buffers that hold results go into the results' memory."""

    def __init__(self, layout: Layout, roots: list[torch.Tensor], name: str):
        self.layout, self.roots, self.name, self.next = layout, roots, name, 0

    def __call__(self, sizes: tuple, strides: tuple, dtype: torch.dtype) -> torch.Tensor:
        k, self.next = self.next, self.next + 1
        expected = self.layout.buffers[k] if k < len(self.layout.buffers) else None
        if expected != Buffer(sizes, strides, dtype):
            raise RuntimeError(f"neuron: compiled kernel {self.name} allocated buffer {k} as {sizes}, {strides}, "
                               f"{dtype}, not as at its first call ({expected}); set TORCHNEURON_LAUNCH_BLOCKING=1 "
                               "to run compiled kernels on the host thread")
        root = self.layout.roots.get(k)
        if root is None:
            return _EMPTY_STRIDED_CPU(sizes, strides, dtype)
        return torch.empty(0, dtype=dtype).set_(self.roots[root].untyped_storage(), 0, sizes, strides)


def _learn(outs: list, devices: list[int | None], inputs: list[torch.Tensor], rec: _Record) -> Layout | None:
    """Where each neuron result of the first call lives, or None when a queued call could not be handed it at its
    launch (a result that stays on the host)."""
    pairs = zip(outs, devices, strict=True)
    if any(o is not None and (d is None or not isinstance(o, torch.Tensor)) for o, d in pairs):
        return None
    results = _C._learn_results(outs, inputs)
    if results is None:
        return None
    by_ptr = {ptr: k for k, (_, ptr) in enumerate(rec.buffers) if ptr}  # a freed buffer's address: a later one's
    groups = results.slot_groups  # per result: its fresh storage, or -1
    first: dict[int, int] = {}  # fresh storage -> its first result
    for i, g in enumerate(groups):
        first.setdefault(g, i)
    roots = {by_ptr[p]: g for g, i in first.items() if g >= 0 and (p := _base(outs[i])) in by_ptr}
    copies = frozenset(i for i, g in enumerate(groups) if g >= 0 and g not in roots.values())
    return Layout(results, tuple(b for b, _ in rec.buffers), roots, copies)


class Kernel:
    """A compiled kernel, called boxed (a list of arguments, consumed) like Inductor's own compiled graphs. Its
    neuron inputs enter as CPU views of the same memory. The first call runs on the host thread: results over input
    memory become views of those inputs and fresh memory is adopted by the neuron allocator, copied only when
    something besides the results holds it (`_C._device_results`). Later calls are queued (see the module's doc)."""

    def __init__(self, call: Any, device_inputs: list[int], outputs: list[int | None], name: str = "kernel",
                 graph: fx.GraphModule | None = None, queueable: bool = False):
        self.call, self.device_inputs, self.outputs = call, device_inputs, outputs
        self.name, self.graph = name, graph  # the graph: for the cost model (profilers)
        self.queueable = queueable  # its generated code allocates through `_allocate`
        self.layout: Layout | None = None
        self._boxed_call = True

    def __call__(self, args: list) -> list:
        _C._count_path("compiled")
        if KERNEL_OBSERVERS:  # torchneuron.profiler.profile(ops=False)
            return KERNEL_OBSERVERS[-1](self, args)
        if _C._tracing_device():  # torch.profiler with ProfilerActivity.PrivateUse1
            from ..profiler.kineto import record_kernel

            return record_kernel(self, args)
        if self.layout is not None and not _C._launch_blocking() and torch.get_num_threads() < _CORES:
            return self._launch(args)
        return self.run(args)

    def run(self, args: list) -> list:
        """Run now, on this thread, after the current stream's queued work (the first call, profilers)."""
        inputs = [args[i] for i in self.device_inputs]  # keeps the memory behind the host views alive
        _C._host_args(args, self.device_inputs)
        if not self.queueable or self.layout is not None:
            return _C._device_results(self.call(args), self.outputs, inputs)
        if any(isinstance(a, torch.Tensor) for i, a in enumerate(args) if i not in self.device_inputs):
            # a host tensor argument (a compiled optimizer's CPU step count, which the graph may update in place)
            # is read and written when the call runs: the host thread's
            self.queueable = False
            return _C._device_results(self.call(args), self.outputs, inputs)
        rec = _ALLOCATION.plan = _Record()
        try:
            outs = self.call(args)
        finally:
            _ALLOCATION.plan = None
        results = _C._device_results(outs, self.outputs, inputs)
        self.layout = _learn(list(results), self.outputs, inputs, rec)
        self.queueable = self.layout is not None
        return results

    def _launch(self, args: list) -> list:
        """Queue the call on the current stream: its results handed out now, in the layout of its first call."""
        layout = self.layout
        inputs = [args[i] for i in self.device_inputs]
        device = inputs[0].device.index if inputs else torch.neuron.current_device()
        results, roots = _C._hand_out_results(layout.results, inputs, device)
        _C._host_args(args, self.device_inputs, wait=False)
        host = [*roots, *results]
        _C._host_args(host, [i for i, t in enumerate(host) if t is not None], wait=False)
        _C._queue_kernel(device, self.name, functools.partial(
            _replay, self.call, self.name, layout, args, host[:len(roots)], host[len(roots):]), FULL_THREADS,
            inputs, [*roots, *(r for r in results if r is not None)])
        return results


def _replay(call: Any, name: str, layout: Layout, args: list, roots: list[torch.Tensor],
            results: list[torch.Tensor | None]) -> None:
    """A queued call, on the stream's worker: the generated code over host views, its result buffers allocated in
    the results' memory; a result anywhere else than its first call put it raises (at the next sync point)."""
    plan = _ALLOCATION.plan = _Replay(layout, roots, name)
    try:
        outs = call(args)
    finally:
        _ALLOCATION.plan = None
    if plan.next != len(layout.buffers):
        raise RuntimeError(f"neuron: compiled kernel {name} allocated {plan.next} buffers, {len(layout.buffers)} "
                           "at its first call; set TORCHNEURON_LAUNCH_BLOCKING=1 to run compiled kernels on the host")
    for i, (o, dst) in enumerate(zip(outs, results, strict=True)):
        if dst is None:
            continue
        if i in layout.copies:
            dst.copy_(o)
            continue
        if dst.numel() and (_base(o) != _base(dst) or o.shape != dst.shape or o.stride() != dst.stride() or
                            o.storage_offset() != dst.storage_offset()):
            raise RuntimeError(f"neuron: compiled kernel {name} computed result {i} elsewhere than at its first call; "
                               "set TORCHNEURON_LAUNCH_BLOCKING=1 to run compiled kernels on the host thread")


@dataclass
class Compiled:
    kernel: Kernel
    output_strides: list
    cache_hit: bool
    seconds: float
    source: str


def compile_kernel(gm: fx.GraphModule, example_inputs: list, cache: Cache, inner_kwargs: dict,
                   name: str = "kernel") -> Compiled:
    """Compile one kernel graph (neuron, after the passes) through Inductor for the host, or load it from the
    cache."""
    from torch._inductor.codecache import PyCodeCache

    start = time.perf_counter()
    out_vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in gm.graph.output_node().args[0]]
    outputs = [v.device.index if isinstance(v, torch.Tensor) and v.device.type == "neuron" else None
               for v in out_vals]
    device_inputs = [i for i, x in enumerate(example_inputs)
                     if isinstance(x, torch.Tensor) and x.device.type == "neuron"]
    inputs = to_host(gm, example_inputs)
    visible = gm.graph.output_node().meta.get("user_visible_output_idxs")
    key = digest({"graph": gm.code, "inputs": signature(inputs), "target": target(), "visible": visible,
                  "kwargs": {k: inner_kwargs.get(k) for k in ("is_backward", "is_inference")}})
    # queued calls run on a stream worker: their loops must not hold the GIL, their index checks must not abort
    with kernel_codegen(), cache.inductor_dir():
        entry = cache.load(key)
        if entry is not None:
            call = None
            strides = [tuple(s) if s is not None else None for s in entry["output_strides"]]
            source = entry["source"]
        else:
            call, strides, source = build(gm, inputs, inner_kwargs)
            if call is None:
                cache.store(key, {"graph": gm.code, "source": source, "output_strides": strides})
        queueable = call is None  # a module loaded from its source (no constants it holds)
        if call is None:
            module = PyCodeCache.load(source)
            module.empty_strided_cpu = _allocate  # its buffers come from the call's plan (see `_allocate`)
            call = module.call
    return Compiled(Kernel(call, device_inputs, outputs, name, gm, queueable), strides, entry is not None,
                    time.perf_counter() - start, source)
