"""Public training recipes on `neuron`, each against a single-process reference: FSDP2 with meta-device
initialisation, bf16 mixed precision and a torch.distributed.checkpoint resume (2 ranks); 2-D FSDP + tensor
parallel on a Llama-style model (4 ranks, 2x2 mesh); tensor + sequence parallel (2 ranks); DTensor random
initialisation across shardings (2 ranks). Modelled on torchtitan and PyTorch's FSDP2 / TP tutorials."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist_helpers import init, launch

pytestmark = pytest.mark.slow

VOCAB, DIM, HEADS, KV_HEADS, SEQ, LAYERS = 64, 32, 4, 2, 16, 2


# ---- a Llama-style decoder (RMSNorm, rotary embeddings, grouped-query SDPA, SwiGLU) ----

def rotary(seq: int, head_dim: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq, device=device).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); rotates interleaved pairs."""
    from torch.distributed.tensor import DTensor, Replicate

    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if isinstance(x, DTensor):  # the tables join the computation as replicated DTensors
        cos, sin = (DTensor.from_local(t, x.device_mesh, [Replicate()] * x.device_mesh.ndim) for t in (cos, sin))
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, 1) for t in (k, v))  # GQA as torchtitan: repeat_kv
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(idx.shape[1], DIM // HEADS, idx.device)
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def reset_parameters(self) -> None:
        """Initialise every submodule in place (what FSDP2's meta-device recipe calls after to_empty)."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()


def data(steps: int, batch: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    seqs = (torch.randint(VOCAB, (steps, batch, 1), generator=g) + torch.arange(SEQ + 1)) % VOCAB
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def device() -> torch.device:
    return torch.device("neuron", torch.neuron.current_device())


def reference_losses(model: nn.Module, batches, lr: float = 1e-2) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        loss = model(x.to(device()), y.to(device()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# ---- FSDP2: meta init, bf16 mixed precision, checkpoint and resume ----

def fsdp2_meta_init(ckpt_dir: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.func import functional_call

    r, n = init()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def sharded_model() -> nn.Module:
        with torch.device("meta"):
            model = Llama()
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        model.to_empty(device=device())
        return model

    torch.manual_seed(0)
    model = sharded_model()
    model.reset_parameters()  # random init through DTensor's RNG tracker, shard by shard
    init_full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = data(6)

    def step(m: nn.Module, o: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
        half = len(x) // n
        loss = m(x[r * half:(r + 1) * half].to(device()), y[r * half:(r + 1) * half].to(device()))
        loss.backward()
        o.step()
        o.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, dist.ReduceOp.AVG)
        return loss.item()

    losses = [step(model, opt, *b) for b in batches[:3]]
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    losses += [step(model, opt, *b) for b in batches[3:]]

    resumed = sharded_model()  # fresh, uninitialised memory: everything comes from the checkpoint
    ropt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    msd, osd = get_state_dict(resumed, ropt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(resumed, ropt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed_losses = [step(resumed, ropt, *b) for b in batches[3:]]
    dist.destroy_process_group()

    # The single-process reference: the same init on one device, and the same bf16 mixed-precision step (each
    # rank's half batch in bf16, gradients in float32, averaged), in plain PyTorch.
    torch.manual_seed(0)
    ref = Llama().to(device())
    ref.reset_parameters()
    ref_init = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for x, y in batches:
        half, total = len(x) // n, 0.0
        for i in range(n):
            low = {k: p.detach().bfloat16().requires_grad_() for k, p in ref.named_parameters()}
            loss = functional_call(ref, low, (x[i * half:(i + 1) * half].to(device()),
                                              y[i * half:(i + 1) * half].to(device())))
            grads = torch.autograd.grad(loss, list(low.values()))
            for p, g in zip(ref.parameters(), grads, strict=True):
                p.grad = g.float() / n if p.grad is None else p.grad + g.float() / n
            total += loss.float().item() / n
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(total)
    return {"losses": losses, "resumed": resumed_losses, "ref_losses": ref_losses, "init": init_full,
            "ref_init": ref_init}


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> list[dict[str, Any]]:
    return launch("test_distributed_recipes.py::fsdp2_meta_init", 2, str(tmp_path_factory.mktemp("dcp")))


def test_fsdp2_meta_init_equals_single_process_init(fsdp2) -> None:
    """reset_parameters() on meta-initialised, fully_shard-ed DTensor parameters draws exactly the tensor one
    device draws for the same seed (dim-0 shards take their slice's counters)."""
    for r in fsdp2:
        assert r["init"].keys() == r["ref_init"].keys()
        for k, v in r["init"].items():
            assert torch.equal(v, r["ref_init"][k]), k


def test_fsdp2_bf16_training_and_resume(fsdp2) -> None:
    r0 = fsdp2[0]
    assert r0["losses"][-1] < r0["losses"][0]
    torch.testing.assert_close(r0["losses"], r0["ref_losses"], rtol=1e-5, atol=1e-5)
    assert r0["resumed"] == r0["losses"][3:]  # resuming from the checkpoint continues bit for bit


# ---- tensor (+ sequence) parallel and 2-D FSDP + TP on the Llama model ----

def tp_plan() -> tuple[dict[str, Any], dict[str, Any]]:
    """torchtitan's tensor + sequence parallel plan: (root plan, per-block plan). The residual stream stays local
    and sequence-sharded; q, k and v stay DTensors (use_local_output=False), so SDPA runs on head-sharded
    DTensors."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    root = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    block = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
             "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                             desired_input_layouts=(Replicate(), None, None)),
             "attention.wq": ColwiseParallel(use_local_output=False),
             "attention.wk": ColwiseParallel(use_local_output=False),
             "attention.wv": ColwiseParallel(use_local_output=False),
             "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
             "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
             "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
             "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}
    return root, block


def parallel_llama(mode: str) -> dict[str, Any]:
    """mode "tp+sp": tensor + sequence parallel on all ranks; "fsdp+tp": a (dp, tp) mesh, TP + SP inside, FSDP2
    across."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    r, n = init()
    torch.manual_seed(0)
    base = Llama()  # built on the CPU: every rank and the reference start from the same weights
    batches = data(5)
    ref = reference_losses(copy.deepcopy(base).to(device()), batches)

    if mode == "fsdp+tp":
        mesh = init_device_mesh("neuron", (2, n // 2), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_rank, dp = mesh["tp"], mesh["dp"].get_local_rank(), 2
    else:
        tp_mesh = init_device_mesh("neuron", (n,), mesh_dim_names=("tp",))
        dp_rank, dp = 0, 1
    model = copy.deepcopy(base).to(device())
    root_plan, block_plan = tp_plan()
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, block_plan)
    parallelize_module(model, tp_mesh, root_plan)
    if mode == "fsdp+tp":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        part = len(x) // dp
        sl = slice(dp_rank * part, (dp_rank + 1) * part)
        loss = model(x[sl].to(device()), y[sl].to(device()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if dp > 1:
            dist.all_reduce(loss, dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        losses.append(loss.item())
    dist.destroy_process_group()
    return {"losses": losses, "ref": ref}


@pytest.mark.parametrize("mode,ranks", [("tp+sp", 2), ("fsdp+tp", 4)])
def test_parallel_llama_equals_single_process(mode: str, ranks: int) -> None:
    out = launch("test_distributed_recipes.py::parallel_llama", ranks, mode)
    for r in out:
        assert r["losses"][-1] < r["losses"][0]
        torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-5, atol=1e-5)


# ---- DTensor random initialisation across shardings ----

def dtensor_random() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    init()
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    out = {}
    for name, placement in (("shard0", Shard(0)), ("shard1", Shard(1)), ("replicate", Replicate())):
        torch.manual_seed(0)
        d = distribute_tensor(torch.empty(8, 16, device=device()), mesh, [placement])
        d.normal_()
        d.uniform_()  # a second op starts after the first op's counters, on every rank alike
        out[name] = (d.full_tensor(), d.to_local())
    dist.destroy_process_group()
    return out


def test_dtensor_random_init_across_shardings() -> None:
    """Shard(0) and Replicate draw exactly the single-device tensor for the same seed; Shard(1) shards take DTensor's
    counter ranges (shard index x local size), so each shard is the single-device draw at that offset."""
    ranks = launch("test_distributed_recipes.py::dtensor_random", 2)
    torch.manual_seed(0)
    single = torch.empty(8, 16, device="neuron").normal_()
    single.uniform_()
    torch.manual_seed(0)
    torch.empty(128, device="neuron").normal_()  # the first op's counters
    state = torch.neuron.get_rng_state()
    cols = []
    for i in range(2):
        state[8:] = torch.tensor([128 + 64 * i], dtype=torch.int64).view(torch.uint8)
        torch.neuron.set_rng_state(state)
        cols.append(torch.rand(8, 8, device="neuron").cpu())
    for r, res in enumerate(ranks):
        assert torch.equal(res["shard0"][0], single.cpu())
        assert torch.equal(res["replicate"][0], single.cpu())
        assert torch.equal(res["shard1"][1], cols[r])
    assert not torch.equal(ranks[0]["shard1"][1], ranks[1]["shard1"][1])

