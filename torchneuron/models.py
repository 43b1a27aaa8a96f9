"""Small reference models for the demo, the tests and the benchmarks: a nanoGPT-style GPT and a CNN.

Plain PyTorch, nothing device specific: they are the workloads users port, so they must run unchanged on any
device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1
    sdpa: bool = False  # attention through F.scaled_dot_product_attention (nanoGPT's "flash" path)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.sdpa = cfg.n_head, cfg.sdpa
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.register_buffer("mask", torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool)),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            p = self.attn_drop.p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
            att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
            y = self.attn_drop(att) @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """nanoGPT-style decoder: token + position embeddings, pre-norm blocks, tied output head."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class SmallCNN(nn.Module):
    """A ResNet-flavoured CNN for 32x32 images: conv, batch norm, pooling, dropout, linear head."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 16, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def gpt_batch(cfg: GPTConfig, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic next-token batch: a noisy repeating pattern a model can learn (so losses fall)."""
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=generator)
    seq = (start + torch.arange(cfg.block_size + 1)) % cfg.vocab_size
    noise = torch.rand(seq.shape, generator=generator) < 0.1
    seq = torch.where(noise, torch.randint(0, cfg.vocab_size, seq.shape, generator=generator), seq)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def image_batch(batch: int, generator: torch.Generator, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic images whose class shifts the mean of one colour channel (learnable)."""
    y = torch.randint(0, classes, (batch,), generator=generator)
    x = torch.randn(batch, 3, 32, 32, generator=generator)
    x += (y.float() / classes).view(-1, 1, 1, 1)
    return x, y


def train_steps(model: nn.Module, batches, device: str | torch.device, steps: int, lr: float = 3e-3,
                seed: int = 0, on_step=None) -> list[float]:
    """Train `model` on `device` for `steps` batches with AdamW; returns the losses. Seeds all RNGs first so
    dropout masks match across devices."""
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(seed)
    losses = []
    for step, (x, y) in enumerate(batches):
        if step == steps:
            break
        x, y = x.to(device), y.to(device)
        out = model(x, y) if isinstance(model, TinyGPT) else model(x)
        loss = out[1] if isinstance(out, tuple) else F.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step:
            on_step(step, losses[-1])
    return losses
