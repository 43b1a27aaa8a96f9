"""Partitioning a graph into device kernels, and the executable that runs them.

Every node belongs to a kernel except the ones a pass marked `neuron_eager` (random draws that read values
computed in the graph): those run on the device op by op, in program order, between the kernels before and
after them. Most graphs are a single kernel."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .passes import Lifted


def assign(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Partition ids in program order: a run of kernel nodes shares an id, each eager node has its own."""
    part, ids, prev_eager = {}, -1, True
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        eager = bool(n.meta.get("neuron_eager"))
        if eager or prev_eager:
            ids += 1
        part[n], prev_eager = ids, eager
    return part


def split(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[tuple[str, bool]]]:
    """The graph as a top-level graph calling one submodule per partition: (it, [(name, is_kernel)])."""
    from torch.fx.passes.split_module import split_module

    part = assign(gm)
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    eager_ids = {part[n] for n in part if n.meta.get("neuron_eager")}
    top = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    subs = []
    for n in top.graph.nodes:
        if n.op != "call_module":
            continue
        sub = getattr(top, n.target)
        for p in sub.graph.nodes:  # the meta values the kernel compiler needs
            if p.op == "placeholder" or p.name in vals:
                p.meta.setdefault("val", vals.get(p.name))
        subs.append((n.target, int(n.target.rsplit("_", 1)[1]) not in eager_ids))
    return top, subs


def tuple_output(gm: fx.GraphModule) -> bool:
    """Make the graph return a tuple (what Inductor compiles); True if it returned a single value before."""
    out = gm.graph.output_node()
    if isinstance(out.args[0], (tuple, list)):
        return False
    out.args = ((out.args[0],),)
    gm.recompile()
    return True


class KernelModule(torch.nn.Module):
    """Stands in for a kernel submodule in the top-level graph: positional call in, the submodule's outputs
    out."""

    def __init__(self, kernel: Callable[[list], list], single: bool):
        super().__init__()
        self.kernel, self.single = kernel, single

    def forward(self, *args: Any) -> Any:
        out = self.kernel(list(args))
        return out[0] if self.single else tuple(out)


class EagerModule(torch.nn.Module):
    """Stands in for an eager partition (device ops between kernels): its results leave it in the layout the graph
    was traced with. A device op may lay a result out otherwise than its meta kernel says (a fused op's padded
    or permuted buffers), while a compiled kernel is compiled for, and asserts, the traced strides of its inputs;
    such a result is copied into the traced layout (Inductor's own fallback kernels restride the same way)."""

    def __init__(self, sub: fx.GraphModule):
        super().__init__()
        self.sub = sub
        outs = sub.graph.output_node().args[0]
        self.single = not isinstance(outs, (tuple, list))
        vals = [_val(a) for a in ((outs,) if self.single else outs)]
        self.layouts = [(tuple(v.shape), tuple(v.stride())) if isinstance(v, torch.Tensor) else None for v in vals]

    def forward(self, *args: Any) -> Any:
        out = self.sub(*args)
        out = [out] if self.single else list(out)
        for i, layout in enumerate(self.layouts):
            if layout is not None and isinstance(t := out[i], torch.Tensor) and t.stride() != layout[1]:
                out[i] = restride(t, *layout)
        return out[0] if self.single else tuple(out)


def restride(t: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    """A copy of `t` with these strides."""
    if tuple(t.shape) != shape:
        raise RuntimeError(f"neuron: a device op between compiled kernels returned shape {tuple(t.shape)} where the "
                           f"graph was traced with {shape}")
    return torch.empty_strided(shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


class Executable:
    """A compiled graph, called boxed: appends the lifted constants and the prologue's random draws to the
    arguments, then runs the kernel (or the top-level graph of kernels and eager nodes)."""

    def __init__(self, body: Callable[[list], list], lifted: Lifted):
        self.body, self.constants, self.draws = body, lifted.constants, lifted.draws
        self._boxed_call = True  # an instance attribute: it survives functools.wraps in Dynamo's wrappers

    def __call__(self, args: list) -> list:
        args.extend(self.constants)
        args.extend(draw() for draw in self.draws)
        return self.body(args)


def run_top(top: fx.GraphModule) -> Callable[[list], list]:
    def body(args: list) -> list:
        out = top(*args)
        args.clear()
        return list(out)
    return body
