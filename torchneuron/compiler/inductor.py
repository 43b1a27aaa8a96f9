"""The one Inductor build both compiled graphs (kernel.py) and fused eager groups (eager_fusion.py) go through.

A host graph is compiled by Inductor's CPU backend with Inductor's pickling FX-graph cache off (the compile cache,
compiler/cache.py, stores the generated source text), keyed by the modelled target (`target()`), and its kernels
are bound without the GIL (`GIL_FREE_KERNELS`) because a stream worker runs them while the host thread launches.
Importing this module is cheap: Inductor loads at the first build."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .._version import __version__
from ..runtime import patches
from .cache import digest

ABI = 1  # bump when the meaning of a cache entry (a compiled graph's or a fused group's) changes


def target() -> dict:
    """What generated code depends on beyond its graph: the modelled device, versions, threads, ISA, Inductor's
    configuration. Part of every compile-cache key."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    cfg = torch.neuron.config()
    return {"instance": cfg.instance.name, "chip": cfg.chip.name, "lnc": cfg.lnc,
            "dtype_policy": cfg.dtype_policy,
            "torch": torch.__version__, "torchneuron": __version__, "abi": ABI,
            "threads": torch.get_num_threads(), "isa": str(pick_vec_isa()),
            "inductor": digest(inductor_config.save_config_portable())}


def build(gm: fx.GraphModule, inputs: list, inner_kwargs: dict) -> tuple[Any, list, str]:
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


# Inductor's Python binding of a CPU kernel holds the GIL while the loop runs; fused groups and compiled graphs run on
# a stream worker, and holding the GIL there would stop the host thread from launching (the overlap async execution
# is for).
_GIL_FREE_CALL = ("auto parsed = std::make_tuple({}); {{ struct NoGil {{ PyThreadState* s = PyEval_SaveThread();"
                  " ~NoGil() {{ PyEval_RestoreThread(s); }} }} nogil; std::apply(kernel, parsed); }} Py_RETURN_NONE;")


def _gil_free_bindings(done: patches.Applied) -> None:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    done.replace(CppPythonBindingsCodeCache, "call_entry_function", _GIL_FREE_CALL)


GIL_FREE_KERNELS = patches.declare(
    "gil-free-kernels", "torch._inductor.codecache.CppPythonBindingsCodeCache.call_entry_function (while a fused "
    "group or a compiled graph's kernel compiles or loads)", "a kernel's loop runs without the GIL, so the host "
    "thread keeps launching while a stream worker runs it (its binding is a different source, so a different cache "
    "entry)", "tests/test_eager_fusion.py::test_a_fused_kernel_runs_without_the_gil", _gil_free_bindings,
    when="on demand")
