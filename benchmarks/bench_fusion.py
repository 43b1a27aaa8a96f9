"""Adaptive eager fusion on the host: the compiled kernel of bias + GELU + residual + layer norm (one group, what
the stream worker will run) vs the same aten ops one by one on CPU tensors. The "neuron" column is the fused
kernel."""
from __future__ import annotations

import torch

from benchmarks.common import interleaved, row
from torchneuron.compiler.eager_fusion import Input, Node, Spec, Value, compile_group, stats

aten = torch.ops.aten


def run(quick: bool = False) -> list[dict]:
    shape, d = ((16, 512, 768) if quick else (64, 512, 768)), 768
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    b, w, lb = (torch.randn(d, generator=g) for _ in range(3))
    ins = [x, b, r, w, lb]
    nodes = (Node("aten::add.Tensor", (Input(0), Input(1))), Node("aten::gelu", (Value(0),)),
             Node("aten::add.Tensor", (Value(1), Input(2))),
             Node("aten::native_layer_norm", (Value(2), [d], Input(3), Input(4), 1e-5)))
    outputs = (Value(3, 0), Value(3, 1), Value(3, 2))
    kernel = compile_group(nodes, tuple(Spec(tuple(t.shape), t.stride(), t.dtype) for t in ins), outputs)
    if kernel is None:
        raise RuntimeError(f"the chain did not compile: {stats().last_failure}")
    outs = [torch.empty_strided(s.sizes, s.strides, dtype=s.dtype) for s in kernel.out_specs]

    def unfused():
        return aten.native_layer_norm(aten.add.Tensor(aten.gelu(aten.add.Tensor(x, b)), r), [d], w, lb, 1e-5)

    t = interleaved({"fused": lambda: kernel(ins, outs), "cpu": unfused}, calls=2 if quick else 5,
                    repeats=3 if quick else 7)
    return [row(f"fused bias+GELU+residual+LN {'x'.join(map(str, shape))}", t["fused"] * 1e3, t["cpu"] * 1e3, "ms")]
