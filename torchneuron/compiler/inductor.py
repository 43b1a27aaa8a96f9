"""The one Inductor build both compiled graphs (kernel.py) and fused eager groups (eager_fusion.py) go through.

A host graph is compiled by Inductor's CPU backend with Inductor's pickling FX-graph cache off (the compile cache,
compiler/cache.py, stores the generated source text), keyed by the modelled target (`target()`), and its kernels
are bound without the GIL (`GIL_FREE_KERNELS`) because a stream worker runs them while the host thread launches.
Importing this module is cheap: Inductor loads at the first build."""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from .._version import __version__
from ..runtime import patches
from .cache import digest

ABI = 2  # bump when the meaning of a cache entry (a compiled graph's or a fused group's) changes


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


# Inductor's CPU kernel checks an indirect index (index_select, embedding, gather, scatter) with TORCH_CHECK, which
# throws; inside the kernel's OpenMP parallel region an exception cannot leave a thread and the process aborts
# (plain CPU Inductor too, with more than one thread). In the kernels Inductor's loop code generator writes, each
# such check instead notes its error in the per-call flag Inductor's own integer-division check uses (value 2 + the
# check's number) and skips the rest of the loop iteration (its loads and stores at that index; the results are never
# handed back); the kernel raises once the parallel region is over. A check with no loop around it, or inside a
# lambda (a masked load's body), where `continue` cannot go, and the checks of template kernels (flex attention's,
# GEMM's) stay Inductor's.
_FLAG = "inductor_cpu_integer_div_error"
_THROW = f"inductor_cpu_throw_if_integer_div_error({_FLAG});"
_CHECK = re.compile(r'TORCH_CHECK\((.*), ("index out of bounds: [^"]*")\);')


def _loop_without_lambda(openers: list[str]) -> bool:
    """Whether the innermost enclosing for loop, with no lambda between, exists (so `continue` is valid there);
    `openers` is the code that opened each enclosing brace, outermost first."""
    for opener in reversed(openers):
        if "[&]" in opener or "[=]" in opener or opener.startswith("[]"):
            return False
        if re.match(r"for\s*\(", opener):
            return True
    return False


def _checks_after_the_region(code: str) -> str:
    """A kernel's index checks rewritten to note and skip (see above), and its raise after the parallel region."""
    if _THROW not in code or "index out of bounds" not in code:
        return code
    lines, messages = code.split("\n"), []
    openers: list[str] = []  # for each open brace, the code that opened it
    previous = ""
    for i, line in enumerate(lines):
        if (m := _CHECK.search(line)) and _loop_without_lambda(openers):
            lines[i] = (line[:m.start()] + f"if (C10_UNLIKELY(!({m[1]}))) {{ inductor_cpu_integer_div_error_flag->"
                        f"store({2 + len(messages)}, std::memory_order_relaxed); continue; }}" + line[m.end():])
            messages.append(m[2])
        code_only = re.sub(r'"(\\.|[^"\\])*"', '""', line)
        for j, ch in enumerate(code_only):
            if ch == "{":
                openers.append(code_only[:j].strip() or previous)
            elif ch == "}" and openers:
                openers.pop()
        if code_only.strip():
            previous = code_only.strip()
    if not messages:
        return code
    raise_ = (f"if (const int e = {_FLAG}.load(std::memory_order_acquire); e >= 2) {{ static const char* const "
              f"index_checks[] = {{{', '.join(messages)}}}; TORCH_CHECK(false, index_checks[e - 2]); }} {_THROW}")
    return "\n".join(lines).replace(_THROW, raise_)


def _index_checks_after_the_region(done: patches.Applied) -> None:
    from torch._inductor.codegen.cpp import KernelGroup

    group = KernelGroup.codegen_group
    done.replace(KernelGroup, "codegen_group", lambda self, name=None: _checks_after_the_region(group(self, name)))


INDEX_CHECKS_AFTER_THE_REGION = patches.declare(
    "index-checks-after-the-parallel-region", "torch._inductor.codegen.cpp.KernelGroup.codegen_group (while a fused "
    "group or a compiled graph compiles)",
    "an out-of-range index in a compiled kernel raises instead of aborting the process: Inductor's check throws "
    "inside the OpenMP parallel region, where an exception ends the process",
    "tests/test_async_probes.py::test_a_compiled_kernels_out_of_range_index_raises_and_the_process_survives",
    _index_checks_after_the_region, when="on demand")


@contextlib.contextmanager
def kernel_codegen() -> Iterator[None]:
    """Inductor's CPU code generation as the device needs it, for one build or load of a compiled graph or fused
    group: GIL-free bindings and index checks that raise after the parallel region."""
    for patch in (GIL_FREE_KERNELS, INDEX_CHECKS_AFTER_THE_REGION):
        patches.apply(patch)
    try:
        yield
    finally:
        for patch in (GIL_FREE_KERNELS, INDEX_CHECKS_AFTER_THE_REGION):
            patches.undo(patch)
