"""Eager `neuron` vs plain PyTorch CPU in the same process: per-op latency and training steps."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import FOREACH, interleaved, row
from torchneuron.compiler.eager_fusion import AFTER
from torchneuron.models import GPTConfig, SmallCNN, TinyGPT, gpt_batch, image_batch


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    def step():
        out = model(x, y) if isinstance(model, TinyGPT) else model(x)
        loss = out[1] if isinstance(out, tuple) else F.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def _pair(make_model, make_batch):
    """The same model and batch on each device, as training-step closures."""
    torch.manual_seed(0)
    model, (x, y) = make_model(), make_batch()
    fns = {}
    for dev in ("cpu", "neuron"):
        m = copy.deepcopy(model).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=FOREACH)
        fns[dev] = _train_step(m, opt, x.to(dev), y.to(dev))
    return fns


def _fused_chain(p: float, shape: tuple[int, int, int]):
    """bias + GELU + dropout + residual + layer norm (a transformer block's epilogue), forward only: the run of
    elementwise ops and a reduction that adaptive eager fusion should turn into one kernel."""
    torch.manual_seed(0)
    x, residual, bias = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    fns = {}
    for dev in ("cpu", "neuron"):
        drop, norm = nn.Dropout(p).train(), nn.LayerNorm(shape[-1]).to(dev)
        xd, rd, bd = x.to(dev), residual.to(dev), bias.to(dev)

        def chain(drop=drop, norm=norm, xd=xd, rd=rd, bd=bd, held=[]):  # noqa: B006  (the caller's result)
            with torch.no_grad():
                held[:] = [norm(drop(F.gelu(xd + bd)) + rd)]  # kept until the next call, as a model's output is
        fns[dev] = chain
    return fns


def run(quick: bool = False) -> list[dict]:
    reps = 5 if quick else 9
    rows = []
    a = {d: torch.randn(16, device=d) for d in ("cpu", "neuron")}
    t = interleaved({d: (lambda d=d: a[d] + a[d]) for d in a}, calls=2000 if quick else 5000, repeats=reps)
    rows.append(row("add, 16 elements", t["neuron"] * 1e6, t["cpu"] * 1e6, "us", 1.2))
    m = {d: torch.randn(1024, 1024, device=d) for d in ("cpu", "neuron")}
    t = interleaved({d: (lambda d=d: m[d] @ m[d]) for d in m}, calls=3 if quick else 10, repeats=reps)
    rows.append(row("matmul 1024x1024", t["neuron"] * 1e3, t["cpu"] * 1e3, "ms", 1.05))
    for p, target in ((0.1, 1 / 1.5), (0.0, None)):  # p=0: the same chain without the dropout mask's RNG
        # warm up past eager fusion's AFTER-th sighting: the group compiles (Inductor) outside the timed repeats
        t = interleaved(_fused_chain(p, (64, 512, 768)), calls=1 if quick else 2, repeats=reps, warmup=AFTER + 1)
        name = "fused chain (bias+GELU+dropout+residual+layernorm)" if p else "fused chain, dropout p=0"
        rows.append(row(name, t["neuron"] * 1e3, t["cpu"] * 1e3, "ms", target))
    mlp = _pair(lambda: nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                                      nn.Linear(512, 10)),
                lambda: (torch.randn(64, 256), torch.randint(0, 10, (64,))))
    t = interleaved(mlp, calls=10 if quick else 30, repeats=reps)
    rows.append(row("MLP training step", t["neuron"] * 1e3, t["cpu"] * 1e3, "ms", 0.85))
    cfg = GPTConfig()
    gpt = _pair(lambda: TinyGPT(cfg), lambda: gpt_batch(cfg, 8, torch.Generator().manual_seed(0)))
    t = interleaved(gpt, calls=3 if quick else 8, repeats=reps)
    rows.append(row("small-GPT training step", t["neuron"] * 1e3, t["cpu"] * 1e3, "ms", 0.9))
    cfg = GPTConfig(sdpa=True)  # nanoGPT's form: attention is one fused kernel
    gpt = _pair(lambda: TinyGPT(cfg), lambda: gpt_batch(cfg, 8, torch.Generator().manual_seed(0)))
    t = interleaved(gpt, calls=3 if quick else 8, repeats=reps)
    rows.append(row("small-GPT training step, SDPA attention", t["neuron"] * 1e3, t["cpu"] * 1e3, "ms"))
    cnn = _pair(SmallCNN, lambda: image_batch(32, torch.Generator().manual_seed(0)))
    t = interleaved(cnn, calls=3 if quick else 8, repeats=reps)
    rows.append(row("small-CNN training step", t["neuron"] * 1e3, t["cpu"] * 1e3, "ms"))
    return rows
