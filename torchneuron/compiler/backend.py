"""`torch.compile(backend="neuron")`: Dynamo graph -> AOTAutograd (functionalized forward and backward
graphs) -> the neuron FX passes -> partition into device kernels -> Inductor CPU code generation for the host
-> executable.

AOTAutograd runs through Inductor's `compile_fx` orchestration (its joint-graph passes and min-cut
partitioner) with the neuron decomposition table, and `_compile_graph` as the per-graph compiler. Shapes are
static, as on Trainium: each new input signature compiles a new executable, counted as a recompile.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from ..hardware import config
from ..hardware.config import COMPILE_FALLBACKS
from . import metrics
from .cache import Cache


class CompileError(RuntimeError):
    """A graph the neuron compiler could not compile (TORCHNEURON_COMPILE_FALLBACK=eager runs it eagerly)."""


class DynamicShapesError(RuntimeError):
    """torch.compile(dynamic=True): the device compiles static shapes only."""


@dataclasses.dataclass
class Options:
    model_name: str | None = None
    fallback: str = "error"
    ignored: tuple[str, ...] = ()

    @classmethod
    def parse(cls, options: dict | None, mode: str | None) -> Options:
        options = dict(options or {})
        fallback = str(options.pop("fallback", config.current().compile_fallback)).strip().lower()
        if fallback not in COMPILE_FALLBACKS:
            raise ValueError(f"TORCHNEURON_COMPILE_FALLBACK (or options['fallback']) = {fallback!r}: choose "
                             f"{' or '.join(COMPILE_FALLBACKS)}")
        ignored = tuple(sorted(options.keys() - {"model_name"})) + ((f"mode={mode}",) if mode else ())
        if ignored:
            warnings.warn(f"torch.compile(backend='neuron') ignores {', '.join(ignored)}: the neuron "
                          "compiler has one mode (no CUDA graphs, no autotuning) and compiles with it",
                          stacklevel=3)
        return cls(options.get("model_name"), fallback, ignored)


@dataclasses.dataclass
class Session:
    """One compile of one Dynamo graph: what the per-graph compiler saw, for the metrics and debug files."""

    name: str
    cache: Cache
    debug: Path | None
    stage: str = "AOTAutograd"
    kernel_graph: fx.GraphModule | None = None
    kernels: int = 0
    cached: int = 0
    host_ops: Counter = dataclasses.field(default_factory=Counter)
    op_engines: dict[str, str] = dataclasses.field(default_factory=dict)
    eager_nodes: int = 0
    rng_draws: int = 0
    float64_rounded: int = 0

    def write(self, filename: str, text: str) -> None:
        if self.debug is not None:
            self.debug.mkdir(parents=True, exist_ok=True)
            (self.debug / filename).write_text(text)


def neuron_backend(gm: fx.GraphModule, example_inputs: list, *, mode: str | None = None,
                   options: dict | None = None, **kwargs: Any) -> Any:
    """The `neuron` torch.compile backend (entry point `torch_dynamo_backends`)."""
    import torch._dynamo

    from ..hardware import aws

    if aws.installed():  # AWS's torch-neuronx owns `neuron`: its compiler compiles (docs/ecosystem.md)
        given = {k: v for k, v in (("mode", mode), ("options", options)) if v is not None}
        return aws.compile_backend()(gm, example_inputs, **given, **kwargs)

    torch.neuron._lazy_init()  # compiling for the device is a use of it: an invalid configuration raises here
    opts = Options.parse({**(options or {}), **kwargs}, mode)
    name = _graph_name(opts.model_name)
    if _symbolic(example_inputs):
        if not torch._dynamo.config.assume_static_by_default:
            raise DynamicShapesError(
                f"torch.compile(dynamic=True) is not supported by the neuron backend (graph {name}): "
                "Trainium executables have static shapes. Drop dynamic=True (or pass dynamic=False): each "
                "new input shape then compiles its own executable, reported as a recompile in "
                "torch.neuron.get_dynamo_metrics(); pad inputs to a few sizes to bound the compiles.")
        return _Specializing(gm, opts, name)  # Dynamo generalised after a shape change: compile per shape
    return _compile(gm, example_inputs, opts, name)


def _graph_name(model_name: str | None) -> str:
    """`<model_name or the compiled function's name>_<Dynamo frame id>`: the same for every recompile."""
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch._guards import CompileContext

    try:
        code = InstructionTranslator.current_tx().f_code
    except AttributeError:  # called outside a Dynamo trace
        code = None
    base = model_name or re.sub(r"\W", "", code.co_name if code else "") or "graph"
    cid = CompileContext.current_compile_id()
    return f"{base}_{cid.frame_id}" if cid is not None and cid.frame_id is not None else base


def _symbolic(inputs: list) -> bool:
    return any(isinstance(x, torch.SymInt) or isinstance(x, torch.Tensor) and
               any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride())) for x in inputs)


class _Specializing:
    """Dynamo made this graph dynamic after seeing a second shape; the device has static shapes, so each
    concrete input signature gets its own executable (each compile is counted as a recompile)."""

    def __init__(self, gm: fx.GraphModule, opts: Options, name: str):
        self.gm, self.opts, self.name, self.variants = gm, opts, name, {}

    def __call__(self, *args: Any) -> Any:
        key = tuple((tuple(a.shape), tuple(a.stride()), a.dtype, a.device) if isinstance(a, torch.Tensor)
                    else a for a in args)
        fn = self.variants.get(key)
        if fn is None:
            fn = self.variants[key] = _compile(self.gm, list(args), self.opts, self.name)
        return fn(*args)


def _compile(gm: fx.GraphModule, example_inputs: list, opts: Options, name: str) -> Any:
    from torch._dynamo.exc import SkipFrame, TensorifyScalarRestartAnalysis, exceptions_allowed_to_be_fallback
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    from .passes import decompositions

    recompiles = metrics.next_compile(name)
    debug_root = config.current().debug_dir
    session = Session(name, Cache(), debug_root / f"{name}_{recompiles}" if debug_root else None)
    session.write("dynamo.fx.txt", gm.print_readable(print_output=False, include_stride=True,
                                                     include_device=True))
    reason = getattr(gm, "compile_subgraph_reason", None)
    row = {"name": name, "nodes": sum(n.op not in ("placeholder", "output") for n in gm.graph.nodes),
           "recompiles": recompiles, "graph_break": reason.reason if reason and reason.graph_break else None,
           "fallback": None, "error": None, "ignored_options": list(opts.ignored)}
    start = time.perf_counter()
    # The backward compiles now, not at the first backward(): failures surface here and the metrics are whole.
    try:
        with functorch_config.patch(force_non_lazy_backward_lowering=True, enable_autograd_cache=False):
            compiled = compile_fx(gm, example_inputs, decompositions=decompositions(),
                                  inner_compile=functools.partial(_compile_graph, session))
    except (*exceptions_allowed_to_be_fallback, TensorifyScalarRestartAnalysis, SkipFrame):
        raise  # Dynamo's own signals (e.g. a data-dependent op): it breaks the graph there and retries
    except Exception as e:  # every failure is reported, then raised or run eagerly
        msg = _failure_message(session, e)
        session.write("error.txt", msg)
        row["error"] = msg
        if opts.fallback == "error":
            metrics.record(_finish(row, session, start))
            raise CompileError(msg) from e
        warnings.warn(f"{msg}\nTORCHNEURON_COMPILE_FALLBACK=eager: graph {name} runs eagerly on neuron",
                      stacklevel=2)
        row["fallback"] = "eager"
        compiled = gm.forward
    metrics.record(_finish(row, session, start))
    return compiled


def _finish(row: dict, session: Session, start: float) -> dict:
    row.update(compile_time_s=time.perf_counter() - start, kernels=session.kernels,
               cache_hit=0 < session.kernels == session.cached, cached_kernels=session.cached,
               host_ops=dict(session.host_ops), op_engines=dict(session.op_engines), eager_nodes=session.eager_nodes,
               rng_draws=session.rng_draws,
               float64_rounded=session.float64_rounded)
    return row


def _failure_message(session: Session, e: BaseException | None) -> str:
    """Name the graph and, where it can be found, the node that failed."""
    node, seen, first = None, set(), e
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        m = re.search(r"target: (\S+)", str(e))
        if m:
            graph = session.kernel_graph.graph.nodes if session.kernel_graph is not None else []
            found = next((n for n in graph if str(n.target) == m.group(1)), None)
            node = f"{found.name} ({found.target})" if found is not None else m.group(1)
            break
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    e = e or first
    cause = f"{type(e).__name__}: {e}".strip().splitlines()
    return (f"torch.compile(backend='neuron') could not compile graph {session.name} ({session.stage}, "
            f"node {node or 'unknown'}): {cause[0]}. "
            "Set TORCHNEURON_COMPILE_FALLBACK=eager to run this graph eagerly on neuron instead.")


def _compile_graph(session: Session, gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Any:
    """The per-graph compiler AOTAutograd calls for the forward, backward or inference graph."""
    from torch._guards import TracingContext

    from . import partition, passes
    from .kernel import compile_kernel

    stage = ("backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference")
             else "forward")
    session.stage, session.kernel_graph = f"{stage} passes", gm
    session.write(f"{stage}.before.fx.txt", gm.print_readable(print_output=False, include_stride=True))
    report, lifted = passes.run(gm)
    session.write(f"{stage}.after.fx.txt", gm.print_readable(print_output=False, include_stride=True))
    if report.float64_rounded:
        warnings.warn(f"neuron: graph {session.name} ({stage}) computes float64 values in "
                      f"{len(report.float64_rounded)} ops; Trainium has no fp64, so they carry float32 "
                      "precision (TORCHNEURON_DTYPE_POLICY=host keeps full precision)", stacklevel=2)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = list(example_inputs) + [n.meta["val"] for n in placeholders[len(example_inputs):]]
    kernels = []
    if not report.eager_nodes:
        session.stage = f"{stage} kernel 0 (Inductor)"
        c = compile_kernel(gm, inputs, session.cache, kwargs, f"{session.name}_{stage}_kernel0")
        kernels.append(c)
        body, strides = c.kernel, c.output_strides
    else:
        top, subs = partition.split(gm)
        for sub_name, is_kernel in subs:
            sub = getattr(top, sub_name)
            if not is_kernel:
                setattr(top, sub_name, partition.EagerModule(sub))
                continue
            session.stage, session.kernel_graph = f"{stage} kernel {len(kernels)} (Inductor)", sub
            single = partition.tuple_output(sub)
            out = sub.graph.output_node()
            out.meta["user_visible_output_idxs"] = list(range(len(out.args[0])))  # keep the graph's strides
            c = compile_kernel(sub, [p.meta["val"] for p in sub.graph.nodes if p.op == "placeholder"],
                               session.cache, kwargs, f"{session.name}_{stage}_kernel{len(kernels)}")
            kernels.append(c)
            setattr(top, sub_name, partition.KernelModule(c.kernel, single))
        body = partition.run_top(top)
        strides = [tuple(v.stride()) if isinstance(v := _val(a), torch.Tensor) else None
                   for a in gm.graph.output_node().args[0]]
    ctx = TracingContext.try_get()
    if ctx is not None and ctx.output_strides is not None:
        ctx.output_strides.extend(strides)
    for i, c in enumerate(kernels):
        session.write(f"{stage}.kernel{i}.py", c.source)
    session.write(f"{stage}.partition.json", json.dumps({
        "graph": session.name, "stage": stage,
        "kernels": [{"index": i, "cache_hit": c.cache_hit, "seconds": round(c.seconds, 3)}
                    for i, c in enumerate(kernels)],
        "engines": dict(report.engines), "host_ops": dict(report.host_ops), "eager_nodes": report.eager_nodes,
        "rng_prologue": report.rng_prologue, "float64_rounded": report.float64_rounded,
        "constants": report.constants}, indent=2))
    session.kernels += len(kernels)
    session.cached += sum(c.cache_hit for c in kernels)
    session.host_ops.update(report.host_ops)
    session.op_engines.update(report.op_engines)
    session.eager_nodes += len(report.eager_nodes)
    session.rng_draws += len(report.rng_prologue)
    session.float64_rounded += len(report.float64_rounded)
    session.stage = "AOTAutograd"
    return partition.Executable(body, lifted)


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else a
