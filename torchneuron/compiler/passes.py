"""The neuron compiler's FX passes over AOTAutograd's functionalized ATen graphs, in the order they run.

AOTAutograd already decomposed each graph with `decompositions()`; the passes then classify every op against
the device's native op table, apply the Trainium float64 rule, turn tensor constants into inputs (so a
compiled kernel holds no data and its generated code can be cached as text), and take random draws out of the
kernels so they come from the neuron generator exactly as eager mode draws them."""
from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..runtime.optable import op_info

aten, prims = torch.ops.aten, torch.ops.prims

def decompositions() -> dict:
    """What AOTAutograd decomposes: Inductor's table (down to the ops its host code generator lowers), plus
    PyTorch's core decomposition of any op the device does not run natively and Inductor would only call as
    an ATen kernel. Composite ops keep their own decomposition; random primitives (and ops the op table says
    `decompose=False`: their decompositions ask the device for Inductor features it lacks) stay whole."""
    from torch._decomp import core_aten_decompositions
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import fallbacks, lowerings

    table = dict(select_decomp_table())
    for op, fn in core_aten_decompositions().items():
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
        if op not in table and not op_info(op).native and not composite and (op not in lowerings or op in fallbacks):
            table[op] = fn
    return {op: fn for op, fn in table.items() if op_info(op).decompose and not op_info(op).random}


def engine_of(op: Any) -> str | None:
    """The engine an op runs on (the op table's: "host" for a host fallback), None for a node that is not an op."""
    return op_info(op).engine if isinstance(op, torch._ops.OpOverload) else None


def is_random(op: Any) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


@dataclass
class Report:
    """What the passes found in one graph; saved as the partition report and summarised in the metrics."""

    engines: Counter = field(default_factory=Counter)
    host_ops: Counter = field(default_factory=Counter)
    op_engines: dict[str, str] = field(default_factory=dict)  # "aten::mm" -> "tensor": each op's classification
    float64_rounded: list[str] = field(default_factory=list)
    constants: list[str] = field(default_factory=list)
    rng_prologue: list[str] = field(default_factory=list)
    eager_nodes: dict[str, str] = field(default_factory=dict)


@dataclass
class Lifted:
    """Values the executable appends to a graph's inputs on every call: constants, then prologue draws."""

    constants: list[torch.Tensor] = field(default_factory=list)
    draws: list[Callable[[], torch.Tensor]] = field(default_factory=list)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _fake(fn: Callable, *args: Any) -> Any:
    """Run `fn` on the fake values of `args` (nodes) to get the meta value of a node made by a pass."""
    return fn(*fx.node.map_aggregate(args, _val))


def _placeholder(gm: fx.GraphModule, name: str, val: Any) -> fx.Node:
    """A new last input (the first one when the graph has none: it then only makes tensors or reads scalars)."""
    last = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(last[-1]) if last else gm.graph.inserting_before(next(iter(gm.graph.nodes))):
        p = gm.graph.placeholder(name)
    p.meta["val"] = val
    return p


def classify(gm: fx.GraphModule, report: Report, lifted: Lifted) -> None:
    """Count ops per engine; ops that are not native stay in the kernel as host code and are reported."""
    for n in gm.graph.nodes:
        engine = engine_of(n.target) if n.op == "call_function" else None
        if engine:
            report.engines[engine] += 1
            report.op_engines[n.target.name()] = engine
        if engine == "host":
            report.host_ops[str(n.target)] += 1


def round_float64(gm: fx.GraphModule, report: Report, lifted: Lifted) -> None:
    """TORCHNEURON_DTYPE_POLICY=trainium: float64 results carry float32 precision, as in eager mode (every
    op that computes a float64 value is followed by a round trip through float32; data movement keeps its
    bits)."""
    if torch.neuron.config().dtype_policy != "trainium":
        return
    wide = {torch.float64: torch.float32, torch.complex128: torch.complex64}
    for n in list(gm.graph.nodes):
        v = n.meta.get("val")
        if n.op != "call_function" or not isinstance(v, torch.Tensor) or v.dtype not in wide:
            continue
        if v.device.type != "neuron" or not isinstance(n.target, torch._ops.OpOverload) or op_info(n.target).exact:
            continue
        users = list(n.users)
        with gm.graph.inserting_after(n):
            narrow = gm.graph.call_function(prims.convert_element_type.default, (n, wide[v.dtype]))
        with gm.graph.inserting_after(narrow):
            back = gm.graph.call_function(prims.convert_element_type.default, (narrow, v.dtype))
        narrow.meta["val"] = _fake(prims.convert_element_type.default, n, wide[v.dtype])
        back.meta["val"] = _fake(prims.convert_element_type.default, narrow, v.dtype)
        for u in users:
            u.replace_input_with(n, back)
        report.float64_rounded.append(n.name)


def lift_constants(gm: fx.GraphModule, report: Report, lifted: Lifted) -> None:
    """Tensor constants become inputs: a compiled kernel then holds no data and its code is cacheable text."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    for n in list(gm.graph.nodes):
        if n.op != "get_attr":
            continue
        value = getattr(gm, n.target)
        if not isinstance(value, torch.Tensor):
            continue
        p = _placeholder(gm, f"const_{n.name}", fake_mode.from_tensor(value, static_shapes=True))
        n.replace_all_uses_with(p)
        gm.graph.erase_node(n)
        lifted.constants.append(value)
        report.constants.append(n.target)


def _spec(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device


def _draw(op: Callable, args: tuple, kwargs: dict) -> Callable[[], torch.Tensor]:
    """A thunk that makes the draw on the device: tensor arguments are stand-ins of the right shape (only
    their metadata is read)."""
    def stand_in(a: Any) -> Any:
        if isinstance(a, fx.Node):
            size, stride, dtype, device = _spec(a.meta["val"])
            return lambda: torch.empty_strided(size, stride, dtype=dtype, device=device)
        return lambda: a

    arg_fns = [stand_in(a) for a in args]
    kw_fns = {k: stand_in(v) for k, v in kwargs.items()}
    return lambda: op(*(f() for f in arg_fns), **{k: f() for k, f in kw_fns.items()})


def _dropout_mask(x: torch.Tensor, p1m: float) -> Callable[[], torch.Tensor]:
    """The mask eager `native_dropout` draws on neuron: a contiguous tensor like the input, bernoulli_."""
    shape, dtype, device = tuple(x.shape), x.dtype, x.device
    return lambda: torch.empty(shape, dtype=dtype, device=device).bernoulli_(p1m)


def _rng_state_hops() -> tuple:
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    return run_and_save_rng_state, run_with_rng_state


def lift_rng(gm: fx.GraphModule, report: Report, lifted: Lifted) -> None:
    """Random draws leave the kernels. Draws that need only shapes (dropout masks, rand, uniform_, ...) are
    made on the device before the kernel runs and enter it as inputs; a draw that reads values computed in the
    graph runs on the device in its place, between kernels. Either way the numbers come from the neuron
    generator in program order, so `torch.manual_seed` reproduces eager results exactly."""
    hoisting = True  # hoist only while every earlier draw was hoisted: keeps the draws in program order
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _rng_state_hops():
            # AOTAutograd's RNG functionalisation (a draw recomputed in the backward): save or replay the neuron
            # generator's state around the draw on the device, between kernels, in program order
            hoisting = False
            report.eager_nodes[n.name] = f"{n.target}: a draw run under a saved neuron RNG state"
            for u in (n, *(u for u in n.users if u.target is operator.getitem)):  # with its tuple's items
                u.meta["neuron_eager"] = True
            if "val" not in n.meta and n.target is _rng_state_hops()[1]:  # the backward's replay has none
                n.meta["val"] = _fake(n.args[1], *n.args[2:])
            continue
        if n.op != "call_function" or not is_random(n.target):
            continue
        dropout = op_info(n.target).name == "native_dropout" and n.args[2] is not False
        shape_only = op_info(n.target).random == "shape" or dropout
        if not (hoisting and shape_only):
            hoisting = False
            report.eager_nodes[n.name] = f"{n.target}: a random draw that reads values computed in the graph"
            n.meta["neuron_eager"] = True
            continue
        if dropout:
            x, p = n.args[0], float(n.args[1])
            xv = x.meta["val"]
            mask = _placeholder(gm, f"rng_{n.name}", xv.new_empty(xv.shape))
            lifted.draws.append(_dropout_mask(xv, 1.0 - p))
            scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
            with gm.graph.inserting_before(n):
                masked = gm.graph.call_function(aten.mul.Tensor, (x, mask))
                out = gm.graph.call_function(aten.mul.Tensor, (masked, scale))
                keep = gm.graph.call_function(prims.convert_element_type.default, (mask, torch.bool))
            masked.meta["val"] = _fake(aten.mul.Tensor, x, mask)
            out.meta["val"] = _fake(aten.mul.Tensor, masked, scale)
            keep.meta["val"] = _fake(prims.convert_element_type.default, mask, torch.bool)
            for u in list(n.users):
                assert u.target is operator.getitem, f"unexpected use of native_dropout: {u.format_node()}"
                u.replace_all_uses_with((out, keep)[u.args[1]])
                gm.graph.erase_node(u)
        else:
            p = _placeholder(gm, f"rng_{n.name}", n.meta["val"])
            lifted.draws.append(_draw(n.target, n.args, n.kwargs))
            n.replace_all_uses_with(p)
        gm.graph.erase_node(n)
        report.rng_prologue.append(n.name)


def eager_fused_attention(gm: fx.GraphModule, report: Report, lifted: Lifted) -> None:
    """Fused attention (what F.scaled_dot_product_attention dispatches to on neuron) runs as its device kernel
    between the compiled kernels, with eager's numerics: Inductor's host lowering of the op expects CUDA's outputs
    (its philox seed and offset are host tensors, which a host kernel cannot return as device values). So do
    FlexAttention's higher-order ops in training, by their dense implementation: Inductor's CPU flex template cannot
    return the log-sum-exp a backward needs, and its backward lowering is Triton-only."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and isinstance(n.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)) \
                and op_info(n.target).eager and not _host_flex_template(n):
            report.eager_nodes[n.name] = f"{n.target}: fused attention runs as the device kernel"
            for u in _with_items(n):
                u.meta["neuron_eager"] = True


def _host_flex_template(n: fx.Node) -> bool:
    """An inference FlexAttention (no log-sum-exp or max returned) that Inductor's CPU flex template compiles: it
    stays in the kernel as one fused, block-sparse loop (a 1024-token causal attention ran 6x faster than the
    dense implementation)."""
    if n.target is not torch.ops.higher_order.flex_attention:
        return False
    from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

    options, dtypes = n.args[6], {_val(a).dtype for a in n.args[:3]}
    return (not options.get("OUTPUT_LOGSUMEXP") and not options.get("OUTPUT_MAX") and len(dtypes) == 1
            and dtypes <= {torch.float32, torch.bfloat16, torch.float16} and check_cpu_supported())


def _with_items(n: fx.Node) -> list[fx.Node]:
    """A node and the items taken from its (nested) tuples: a kernel cannot take a tuple as an input."""
    items = [u for u in n.users if u.target is operator.getitem]
    return [n, *(i for u in items for i in _with_items(u))]


Pass = Callable[[fx.GraphModule, Report, Lifted], None]
PASSES: list[Pass] = [classify, round_float64, lift_constants, lift_rng, eager_fused_attention]


def run(gm: fx.GraphModule) -> tuple[Report, Lifted]:
    report, lifted = Report(), Lifted()
    for p in PASSES:
        p(gm, report, lifted)
    gm.graph.lint()
    gm.recompile()
    return report, lifted
