"""Eager `neuron` vs plain PyTorch CPU, each in a process of its own taking turns: per-op latency and training
steps."""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import FOREACH, first_calls, paired, row
from torchneuron.compiler.eager_fusion import AFTER
from torchneuron.models import GPTConfig, SmallCNN, TinyGPT, gpt_batch, image_batch


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))


def _hf_gpt2() -> nn.Module:
    """A transformers GPT-2 built from a config (no download): 12 blocks, so AdamW steps over 148 tensors, as an HF
    model's optimizer does (hundreds of small parameter tensors), with its own SDPA attention and dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel  # the test extra; imported only for this row

    return GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=64, n_head=4, vocab_size=1000, n_positions=64,
                                      attn_implementation="sdpa"))


class _LSTMLM(nn.Module):
    """pytorch/examples' word_language_model in small: an embedding, a 2-layer LSTM over 35 time steps, a decoder.
    Thousands of tiny ops per step (each time step's cell), where launch overheads decide."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.dec = nn.Embedding(1000, 32), nn.LSTM(32, 32, 2, dropout=0.2), nn.Linear(32, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.rnn(self.emb(x))[0]).view(-1, 1000)


class BenchModel(NamedTuple):
    """A benchmark model: made on the CPU from seed 0 with its batch, so both sides train the same model on the same
    batch, and its loss on that batch."""

    make: Callable[[], nn.Module]
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _tokens() -> torch.Tensor:
    return torch.randint(0, 1000, (8, 64), generator=torch.Generator().manual_seed(0))


def _own_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return m(x, y)[1] if isinstance(m, TinyGPT) else F.cross_entropy(m(x), y)


MODELS: dict[str, BenchModel] = {
    "mlp": BenchModel(_mlp, lambda: (torch.randn(64, 256), torch.randint(0, 10, (64,))), _own_loss),
    "gpt": BenchModel(lambda: TinyGPT(GPTConfig()), lambda: gpt_batch(GPTConfig(), 8, torch.Generator().manual_seed(0)),
                      _own_loss),
    "gpt_sdpa": BenchModel(lambda: TinyGPT(GPTConfig(sdpa=True)),  # nanoGPT's form: attention is one fused kernel
                           lambda: gpt_batch(GPTConfig(sdpa=True), 8, torch.Generator().manual_seed(0)), _own_loss),
    "cnn": BenchModel(SmallCNN, lambda: image_batch(32, torch.Generator().manual_seed(0)), _own_loss),
    "lstm": BenchModel(_LSTMLM, lambda: (torch.randint(0, 1000, (35, 20), generator=torch.Generator().manual_seed(0)),
                                         torch.randint(0, 1000, (700,), generator=torch.Generator().manual_seed(1))),
                       _own_loss),
    "hf_gpt2": BenchModel(_hf_gpt2, lambda: (_tokens(),) * 2, lambda m, x, y: m(input_ids=x, labels=y).loss),
}


def train_step(device: str, model: str, read_loss: bool = False) -> Callable[[], None]:
    """A training step (forward, loss, backward, AdamW) of MODELS[model] on `device`. `read_loss`: the loss is read
    between backward and the optimizer step, as HF Trainer's loop does (its NaN filter), so the host waits for the
    device there every step."""
    bm = MODELS[model]
    torch.manual_seed(0)
    m, (x, y) = bm.make().to(device), bm.batch()
    x, y = x.to(device), y.to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=FOREACH)

    def step() -> None:
        loss = bm.loss(m, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if read_loss:
            loss.item()
        opt.step()
    return step


def add(device: str, n: int) -> Callable[[], torch.Tensor]:
    a = torch.randn(n, device=device)
    return lambda: a + a


def matmul(device: str, n: int) -> Callable[[], torch.Tensor]:
    m = torch.randn(n, n, device=device)
    return lambda: m @ m


def fused_chain(device: str, p: float, shape: tuple[int, int, int]) -> Callable[[], None]:
    """bias + GELU + dropout + residual + layer norm (a transformer block's epilogue), forward only: the run of
    elementwise ops and a reduction that adaptive eager fusion should turn into one kernel."""
    torch.manual_seed(0)
    x, residual, bias = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    drop, norm = nn.Dropout(p).train(), nn.LayerNorm(shape[-1]).to(device)
    x, residual, bias = x.to(device), residual.to(device), bias.to(device)
    held: list[torch.Tensor] = []

    def chain() -> None:
        with torch.no_grad():
            held[:] = [norm(drop(F.gelu(x + bias)) + residual)]  # kept until the next call, as a model's output is
    return chain


def run(quick: bool = False) -> list[dict]:
    reps, turn = (5, 0.1) if quick else (9, 0.3)
    rows = []
    t = paired(add, calls=2000 if quick else 5000, repeats=reps, min_turn=turn, n=16)
    rows.append(row("add, 16 elements", t["neuron"] * 1e6, t["cpu"] * 1e6, "us", 1.2))
    t = paired(matmul, calls=3 if quick else 10, repeats=reps, min_turn=turn, n=1024)
    rows.append(row("matmul 1024x1024", t["neuron"] * 1e3, t["cpu"] * 1e3, "ms", 1.05))
    for p, target in ((0.1, 1 / 1.5), (0.0, None)):  # p=0: the same chain without the dropout mask's RNG
        # warm up past eager fusion's AFTER-th sighting: the group compiles (Inductor) outside the timed repeats
        t = paired(fused_chain, calls=1 if quick else 2, repeats=reps, min_turn=turn, warmup=AFTER + 1, p=p,
                   shape=(64, 512, 768))
        name = "fused chain (bias+GELU+dropout+residual+layernorm)" if p else "fused chain, dropout p=0"
        rows.append(row(name, t["neuron"] * 1e3, t["cpu"] * 1e3, "ms", target))
    for model, name, calls, target, read_loss in (
            ("mlp", "MLP training step", 30, 0.85, False),
            ("gpt", "small-GPT training step", 8, 0.9, False),
            ("gpt_sdpa", "small-GPT training step, SDPA attention", 8, None, False),
            ("cnn", "small-CNN training step", 8, None, False),
            ("lstm", "LSTM language-model training step (2 layers, 35 steps)", 8, None, False),
            ("hf_gpt2", "HF GPT-2 training step (12 blocks, 148 tensors)", 4, None, False),
            ("hf_gpt2", "HF GPT-2 training step, loss read before the optimizer step", 4, None, True)):
        t = paired(train_step, calls=calls // 3 if quick else calls, repeats=reps, min_turn=turn, model=model,
                   read_loss=read_loss)
        rows.append(row(name, t["neuron"] * 1e3, t["cpu"] * 1e3, "ms", target))
    # Start-up: from building the model to the end of its 10th step, in fresh processes. With an empty compile
    # cache (a first run: eager fusion's kernels compile in the background meanwhile) and with the one a run left.
    with tempfile.TemporaryDirectory() as root:
        caches: list[str] = []

        def empty() -> str:
            caches.append(tempfile.mkdtemp(dir=root))
            return caches[-1]

        for state, cache_dir in (("empty", empty), ("warm", lambda: caches[0])):
            t = first_calls(train_step, calls=10, cache_dir=cache_dir, repeats=1 if quick else 5, model="gpt")
            rows.append(row(f"small-GPT, start to 10th step, {state} compile cache", t["neuron"] * 1e3,
                            t["cpu"] * 1e3, "ms", 1.0))
    return rows
