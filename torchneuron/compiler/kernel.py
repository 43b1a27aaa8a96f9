"""Device kernels: code generation for the host by Inductor's CPU backend, and the zero-copy device boundary.

A kernel's graph is rewritten from `neuron` to `cpu` and compiled by `compile_fx_inner`, exactly as Inductor
compiles a CPU graph. At run time its neuron inputs enter as CPU views of the same memory (no copy), and the
memory of its results is adopted by the neuron allocator (no copy; counted by
torch.neuron.memory_allocated())."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .. import _C
from .._version import __version__
from ..runtime.tracking import KERNEL_OBSERVERS
from .cache import Cache, digest

CPU = torch.device("cpu")
_DEVICE_STR = re.compile(r"neuron(:\d+)?")
ABI = 1  # bump when the meaning of a cache entry changes


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


def _target() -> dict:
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    cfg = torch.neuron.config()
    return {"instance": cfg.instance.name, "chip": cfg.chip.name, "lnc": cfg.lnc,
            "dtype_policy": cfg.dtype_policy,
            "torch": torch.__version__, "torchneuron": __version__, "abi": ABI,
            "threads": torch.get_num_threads(), "isa": str(pick_vec_isa()),
            "inductor": digest(inductor_config.save_config_portable())}


class Kernel:
    """A compiled kernel, called boxed (a list of arguments, consumed) like Inductor's own compiled graphs. Its
    neuron inputs enter as CPU views of the same memory; results over input memory become views of those
    inputs and fresh memory is adopted by the neuron allocator, copied only when something besides the results
    holds it (`_C._device_results`)."""

    def __init__(self, call: Any, device_inputs: list[int], outputs: list[int | None], name: str = "kernel",
                 graph: fx.GraphModule | None = None):
        self.call, self.device_inputs, self.outputs = call, device_inputs, outputs
        self.name, self.graph = name, graph  # the graph: for the cost model (profilers)
        self._boxed_call = True

    def __call__(self, args: list) -> list:
        if KERNEL_OBSERVERS:  # torchneuron.profiler.profile(ops=False)
            return KERNEL_OBSERVERS[-1](self, args)
        if _C._tracing_device():  # torch.profiler with ProfilerActivity.PrivateUse1
            from ..profiler.kineto import record_kernel

            return record_kernel(self, args)
        return self.run(args)

    def run(self, args: list) -> list:
        inputs = [args[i] for i in self.device_inputs]  # keeps the memory behind the host views alive
        _C._host_args(args, self.device_inputs)
        return _C._device_results(self.call(args), self.outputs, inputs)


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
    key = digest({"graph": gm.code, "inputs": signature(inputs), "target": _target(), "visible": visible,
                  "kwargs": {k: inner_kwargs.get(k) for k in ("is_backward", "is_inference")}})
    with cache.inductor_dir():
        entry = cache.load(key)
        if entry is not None:
            call = PyCodeCache.load(entry["source"]).call
            strides = [tuple(s) if s is not None else None for s in entry["output_strides"]]
            source = entry["source"]
        else:
            call, strides, source = _inductor(gm, inputs, inner_kwargs)
            if call is None:
                call = PyCodeCache.load(source).call
                cache.store(key, {"graph": gm.code, "source": source, "output_strides": strides})
    return Compiled(Kernel(call, device_inputs, outputs, name, gm), strides, entry is not None,
                    time.perf_counter() - start, source)


def _inductor(gm: fx.GraphModule, inputs: list, inner_kwargs: dict) -> tuple[Any, list, str]:
    """Inductor's CPU compile of a host graph, with Inductor's pickling FX-graph cache off (ours stores text).
    Returns (a callable, or None when the module reloads from its source; output strides; source)."""
    from torch._guards import TracingContext
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    kwargs = {k: v for k, v in inner_kwargs.items() if k in ("graph_id", "is_inference", "is_backward")}
    with inductor_config.patch(fx_graph_cache=False), TracingContext.report_output_strides():
        compiled = compile_fx_inner(gm, inputs, cudagraphs=BoxedBool(False), static_input_idxs=[], **kwargs)
    strides = [None if s is None else tuple(int(x) for x in s) for s in compiled.output_strides or []]
    constants = getattr(compiled, "constants", None)
    return (compiled.current_callable if constants else None), strides, compiled.source_code
