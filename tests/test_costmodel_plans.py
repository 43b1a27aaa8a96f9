"""Plans beyond one data- and tensor-parallel step: the CLI's context length, the memory-fit check, FSDP, fp8 and
8-bit weights, and the buyer's GPU comparison; each against values computed here from published numbers."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from torchneuron.costmodel import cli, presets, validation
from torchneuron.costmodel.estimate import compare_gpu, estimate
from torchneuron.costmodel.ops import nxd_moe, op_cost
from torchneuron.costmodel.trace import trace
from torchneuron.hardware.chips import CHIPS

TRN2, LNC = CHIPS["trn2"], 2
CORE_HBM = TRN2.hbm_bytes // TRN2.logical_cores(LNC)  # 24 GiB per trn2 logical core
BF16 = torch.bfloat16


def _llama8b(layers: int | None = None):
    return presets.hf_model(presets.config("llama-8b", **({"num_hidden_layers": layers} if layers else {})))


@pytest.mark.parametrize("context", [16, 8192])
def test_cli_decode_costs_a_cache_of_seq_tokens(monkeypatch, context):
    """`estimate --mode decode --seq N`: the static cache holds N + 1 positions (N cached, one new); per core
    under TP=8 it is 32 layers x (K, V) x 8/8 KV heads x 128 x (N + 1) x 2 bytes, and each layer's attention
    reads all of it: 2 x 4 heads x (N + 1) x (128 + 128) FLOPs."""
    seen = {}

    def spy(*args, **kw):
        seen["r"] = r = estimate(*args, **kw)
        return r

    monkeypatch.setattr(cli, "estimate", spy)
    p = argparse.ArgumentParser()
    cli.add_estimate_arguments(p)
    assert cli.run_estimate(p.parse_args(["--model", "llama-8b", "--mode", "decode", "--seq", str(context),
                                          "--tp", "8", "--compare", "none", "--top", "0"])) == 0
    r = seen["r"]
    assert r.memory["inputs"] == pytest.approx(32 * 2 * 1 * 128 * (context + 1) * 2, rel=1e-3)
    attention = sum(o.flops for o in r.ops if o.op.startswith("_scaled_dot_product"))
    assert attention == pytest.approx(32 * 2 * 4 * (context + 1) * 256, rel=0.01)


def test_training_that_does_not_fit_names_the_smallest_tensor_parallel_degree():
    """Llama-3.1-8B (8.03e9 parameters) trained with AdamW in bf16 keeps 2 + 2 + 12 bytes per parameter (weights,
    gradients, fp32 moments and master weights): 128 GB, on TP=t cores 128 GB / t. With a tiny batch the
    activations are negligible, so the smallest power of two with 128 GB / t <= 24 GiB is what the error names,
    as a tensor-parallel degree or a pipeline depth (a stage holds 1/pp of the layers)."""
    model = _llama8b()
    n = sum(p.numel() for p in model.parameters())
    tp = next(t for t in (2, 4, 8, 16, 32, 64) if 16 * n / t < 0.97 * CORE_HBM)
    assert tp == 8
    with pytest.raises(torch.OutOfMemoryError, match=rf"optimizer .*the smallest change that fits: tp={tp} or "
                                                     rf"pp={tp}$"):
        estimate(model, presets.lm_inputs(model, seq=8), target="trn2", dtype=BF16, compare=None)


def test_serving_that_does_not_fit_names_8bit_weights():
    """Llama-3.3-70B in bf16 on TP=4 trn2 cores: 141 GB / 4 = 35 GB > 24 GiB per core; with 8-bit weights
    70.6 GB / 4 = 17.6 GB fits, so that is the smallest change."""
    model = presets.hf_model(presets.config("llama-70b"))
    n = sum(p.numel() for p in model.parameters())
    assert 2 * n / 4 > CORE_HBM > n / 4 * 1.1
    with pytest.raises(torch.OutOfMemoryError, match=r"weights 32\.9 GiB.*precision='w8'"):
        estimate(model, presets.lm_inputs(model, mode="decode", context=128), target="trn2", mode="decode", tp=4,
                 dtype=BF16, compare=None)
    r = estimate(model, presets.lm_inputs(model, mode="decode", context=128), target="trn2", mode="decode", tp=4,
                 dtype=BF16, compare=None, precision="w8")
    assert r.memory["weights"] == pytest.approx(n / 4)


class Matmul(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(n, n))

    def forward(self, x):
        return x @ self.w


def test_fsdp_shards_state_and_gathers_weights_every_micro_step():
    """ZeRO-3 over dp=4 on one trn2 instance, a [4096, 4096] fp32 weight (64 MiB), 2 micro-steps: weights,
    gradients and the two fp32 moments are a quarter each; each micro-step runs two all-gathers and a
    reduce-scatter of 64 MiB, ring algorithm above 56 MiB (3 steps), each rank moving 3/4 of the buffer at the
    NeuronLink share x the measured efficiency, after the 58 us floor."""
    n = 4096
    with torch.device("meta"):
        model, x = Matmul(n), torch.empty(n, n)
    r = estimate(model, (x,), target="trn2", dp=4, fsdp=True, batch_tokens=2 * 4 * n, compare=None)
    nbytes = n * n * 4
    assert r.micro_steps == 2
    assert r.memory["weights"] == r.memory["gradients"] == pytest.approx(nbytes / 4)
    assert r.memory["optimizer"] == pytest.approx(n * n * 8 / 4)
    busbw = TRN2.link_bw / TRN2.logical_cores(LNC) * TRN2.fabric.efficiency
    one = TRN2.fabric.fixed_s + 3 * TRN2.fabric.hop_s + 3 / 4 * nbytes / busbw
    assert r.by("phase")["grad_sync"] == pytest.approx(2 * 3 * one, rel=1e-6)


def test_fp8_matmul_runs_at_the_fp8_rate_and_mfu_uses_the_fp8_peak():
    """[4096,4096] @ [4096,4096] on a trn2 logical core: fp8 double-row passes K = 256 rows, twice bf16's 128,
    so the matmul takes 2n^3 / (2 x 256 x 128 x 2.4 GHz x 2 cores); MFU divides by the fp8 peak (162.4 TF per
    physical core, S2), not bf16's, and stays below 1."""
    n = 4096
    with torch.device("meta"):
        model, x = Matmul(n), torch.empty(n, n)
    r = estimate(model, (x,), target="trn2", mode="forward", dtype=BF16, precision="fp8", compare=None)
    rate = 2 * 256 * 128 * 2.4e9 * LNC
    assert r.step_time_s == pytest.approx(2 * n**3 / rate + TRN2.launch_s, rel=0.03)
    assert r.mfu == pytest.approx(2 * n**3 / r.step_time_s / (162.4e12 * LNC))
    assert 0 < r.mfu < 1


def test_gpu_comparison_is_the_cheapest_layout_as_fast_as_trainium():
    """Serving: of the H100 tensor-parallel degrees 1, 2, 4, 8 that fit, the comparison is the cheapest per token
    among those at least as fast as the Trainium step; an explicit --gpu-tp/--gpu-count is taken as given."""
    model = _llama8b(layers=4)
    inputs = presets.lm_inputs(model, mode="decode", context=2048)
    r = estimate(model, inputs, target="trn2", mode="decode", tp=8, dtype=BF16)
    tr = trace(model, inputs, train=False, dtype=BF16)
    from torchneuron.costmodel.estimate import Plan

    plan = Plan(mode="decode", tp=8)
    each = {t: compare_gpu(tr, r, plan, "h100", tp=t) for t in (1, 2, 4, 8)}
    fast = [c for c in each.values() if c.step_time_s <= r.step_time_s]
    best = min(fast, key=lambda c: c.cost_per_million) if fast else min(each.values(), key=lambda c: c.step_time_s)
    assert (r.comparison.tp, r.comparison.cost_per_million) == (best.tp, pytest.approx(best.cost_per_million))
    assert each[2].cores == 2 and each[2].cost_per_hour == pytest.approx(55.04 / 8 * 2)
    fp8 = estimate(model, inputs, target="trn2", mode="decode", tp=8, dtype=BF16, gpu_tp=2, gpu_precision="fp8")
    assert fp8.comparison.tp == 2 and fp8.comparison.precision == "fp8"
    assert fp8.comparison.memory["weights"] == pytest.approx(sum(p.numel() for p in model.parameters()) / 2)


def test_a_training_comparison_takes_the_fewest_gpus_that_fit_and_no_ratio_is_given_for_a_job_that_does_not():
    """Llama-3-8B at 4,096 tokens on 8 trn2 cores (1/8 of the instance): its share of a p5 is one H100, whose 80 GB
    cannot hold the weights, gradients and AdamW state (16 bytes a parameter, 128 GB). The comparison takes the fewest
    GPUs that hold it (two, tensor parallel), not the one that does not fit; a comparison forced onto one GPU does
    not fit and the buyer's table prints no cost ratio for it."""
    model = _llama8b()
    inputs = presets.lm_inputs(model, seq=4096)
    r = estimate(model, inputs, target="trn2", tp=8, dtype=BF16)
    assert r.fits and r.comparison.fits and r.comparison.cores == 2
    assert r.comparison.memory["total"] <= r.comparison.memory["capacity"]
    assert "Trainium / GPU cost per token" in cli.buyer_table(r)
    one = estimate(model, inputs, target="trn2", tp=8, dtype=BF16, gpu_count=1, gpu_tp=1)
    assert not one.comparison.fits and one.comparison.memory["total"] > 16 * 8.03e9 * 0.99
    table = cli.buyer_table(one)
    assert "DOES NOT FIT" in table and "no cost ratio: the GPU job does not fit" in table
    assert "cost per token" not in table


def test_a_training_comparison_need_not_keep_trainiums_pipeline_stages():
    """A Trainium job pipelined over 8 cores with one micro-batch idles 7/8 of each core: the GPU job a buyer
    would run is not pipelined the same way. The comparison takes the cheapest fitting layout with or without the
    stages, on as many GPUs as the stages would use (Llama-3-8B at 2k: 2 H100s, tensor parallel, about a sixth of
    the pipelined 8-GPU job's cost per token)."""
    model = _llama8b()
    inputs = presets.lm_inputs(model, seq=2048)
    r = estimate(model, inputs, target="trn2", pp=8, dtype=BF16)
    assert r.comparison.pp == 1 and r.comparison.fits and r.comparison.cores <= 8
    staged = estimate(model, inputs, target="trn2", pp=8, dtype=BF16, gpu_count=1, gpu_tp=1).comparison
    assert staged.pp == 8 and staged.cores == 8
    assert r.comparison.cost_per_million < staged.cost_per_million / 3


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_pipeline_bubble_and_stage_memory(schedule, vpp):
    """4 stages, 8 micro-batches of 512 tokens: a stage runs a quarter of each micro-batch's forward and backward
    over 8 + 3 slots (1F1B, GPipe) or 8 + 3/2 (interleaved, v = 2); between stages each slot sends the 512 x 4096
    bf16 activation forward and its gradient back (4 MiB: recursive halving-doubling, one step, after the 58 us
    floor). A stage holds a quarter of the weights and of the gradients, and activations of min(8, 4) micro-batches
    (1F1B; x (1 + 3/8) interleaved) or all 8 (GPipe) over its quarter of the layers."""
    model = _llama8b(layers=4)
    inputs = presets.lm_inputs(model, seq=512)
    m, p = 8, 4
    kw = dict(target="trn2", dtype=BF16, batch_tokens=m * 512, optimizer=None, compare=None, check_memory=False)
    one = estimate(model, inputs, **kw)
    r = estimate(model, inputs, pp=p, schedule=schedule, vpp=vpp, **kw)
    work = lambda e: sum(e.by("phase").get(k, 0.0) for k in ("forward", "backward"))
    slots = m + (p - 1) / vpp
    assert work(r) == pytest.approx(work(one) / m / p * slots)
    busbw = TRN2.link_bw / TRN2.logical_cores(LNC) * TRN2.fabric.efficiency
    nbytes = 512 * 4096 * 2
    hop = TRN2.fabric.fixed_s + TRN2.fabric.hop_s + nbytes / busbw
    assert r.by("phase")["pipeline"] == pytest.approx(2 * slots * hop)
    assert r.memory["weights"] == pytest.approx(one.memory["weights"] / p)
    inflight = {"1f1b": min(m, p), "gpipe": m, "interleaved": min(m, p) * (1 + (p - 1) / (p * vpp))}[schedule]
    assert r.memory["activations"] == pytest.approx(one.memory["activations"] / 1 * inflight / p)
    assert r.cores == p and 0 < r.mfu < one.mfu  # the bubble idles the stages



def test_ranks_are_ordered_tensor_then_data_parallel_then_pipeline_stages():
    """Megatron-LM's and NxD's rank order (pipeline stages outermost): 2 stages x 8 data-parallel replicas on two
    p5.48xlarge put each stage's 8 replicas on one instance, so their gradient all-reduce (bf16, half the
    parameters each, ring: 2 x 7 steps) never leaves NVLink (470 GB/s, G3), while every activation handed to the
    next stage (512 x 4096 bf16, 4 MiB, sent as halves by both ends) crosses EFA: 15 us NCCL floor + one 15 us EFA
    step + half the 8 MiB buffer at 3,200 Gb/s shared by the instance's 8 GPUs."""
    model = _llama8b(layers=2)
    r = estimate(model, presets.lm_inputs(model, seq=512), target="h100", instance="p5.48xlarge", pp=2, dp=8,
                 dtype=BF16, batch_tokens=16 * 512, optimizer=None, compare=None, check_memory=False)
    params = sum(p.numel() for p in model.parameters())
    sync = 15e-6 + 2 * 7 * 1e-6 + 2 * 7 / 8 * params / 2 * 2 / 470e9
    assert r.by("phase")["grad_sync"] == pytest.approx(sync)
    hop = 15e-6 + 15e-6 + 0.5 * 2 * 512 * 4096 * 2 / (3200e9 / 8 / 8)
    slots = 2 + 1  # 2 micro-batches per replica, one bubble slot (1F1B)
    assert r.by("phase")["pipeline"] == pytest.approx(2 * slots * hop)

def test_search_finds_the_cheapest_configuration_meeting_the_target_and_its_frontier():
    """Serving a 2-layer Llama-3.1-8B at batch 1 and 8: every candidate is the estimate of its own layout, the
    reported choice is the cheapest per token among those within the time per token, and no candidate is both
    cheaper and faster than one on the frontier."""
    from torchneuron.costmodel import search

    def build(batch):
        model = _llama8b(layers=2)
        return model, presets.lm_inputs(model, mode="decode", context=1024, batch=batch)

    target = 2e-3
    cands = search.search(build, mode="decode", target="trn2", gpus=("h100",), batches=(1, 8), latency_s=target)
    assert {c.platform for c in cands} == {"trainium", "gpu"}
    c = next(c for c in cands if c.platform == "gpu" and c.result.tp == 2 and c.result.precision == "w8"
             and c.batch == 8)
    model, inputs = build(8)
    direct = estimate(model, inputs, target="h100", mode="decode", tp=2, dtype=BF16, precision="w8", compare=None)
    assert c.result.step_time_s == pytest.approx(direct.step_time_s)
    assert c.cost_per_million == pytest.approx(direct.cost_per_million)
    for platform in ("trainium", "gpu"):
        mine = [c for c in cands if c.platform == platform]
        ok = [c for c in mine if c.result.step_time_s <= target]
        assert all(c.meets == (c in ok) for c in mine)
        front = search.frontier(mine)
        for f in front:
            assert not any(c.cost_per_million < f.cost_per_million and c.result.step_time_s < f.result.step_time_s
                           for c in mine)
        if ok:
            cheapest = min(ok, key=lambda c: c.cost_per_million)
            assert f"cheapest meeting the target: {search._row(cheapest)}" in search.table(cands)


def test_search_prices_every_platform_as_the_chosen_kind_and_leaves_out_unrated_gpus():
    """--search --pricing capacity-block: trn1.32xlarge at $15.49/h, the H100 on p5.48xlarge at $39.33/h, the H200
    on p5e.48xlarge at $43.26/h (S35); no B200 block rate is published, so the B200 is left out."""
    from torchneuron.costmodel import search

    def build(batch):
        model = _llama8b(layers=1)
        return model, presets.lm_inputs(model, mode="decode", context=128, batch=batch)

    cands = search.search(build, mode="decode", target="trn1", gpus=("h100", "h200", "b200"), batches=(1,),
                          latency_s=1.0, pricing="capacity-block")
    rates = {"trn1.32xlarge": (15.49, 32), "p5.48xlarge": (39.33, 8), "p5e.48xlarge": (43.26, 8)}
    assert {c.result.instance for c in cands} == set(rates)
    for c in cands:
        rate, per_instance = rates[c.result.instance]
        assert c.result.cost_per_hour == pytest.approx(rate * c.result.cores / per_instance)


def test_cli_search_needs_its_target():
    p = argparse.ArgumentParser()
    cli.add_estimate_arguments(p)
    with pytest.raises(ValueError, match="--target-tpot-ms"):
        cli.check_estimate_arguments(p.parse_args(["--model", "llama-8b", "--mode", "decode", "--search"]),
                                     cli.usage_error)


def test_from_profile_reprices_the_recorded_op_mix(tmp_path):
    """A Chrome trace as torchneuron.profiler exports it: process 1 is the host (ignored), devices are 2+. A
    bf16 mm of 2 x 1024^3 FLOPs and 6 MiB, and an fp32 add over 4M elements (48 MiB), each run twice, priced per
    step (2 steps) on a trn2 core compiled: the mm at TensorE's rate from the clock and the array, the add at
    VectorE's fp32 rate or HBM, whichever is slower, plus a kernel's fixed cost per call; on an H100 eager: the
    calibrated matmul rate and HBM, plus a launch and a kernel per call."""
    import json

    from torchneuron.costmodel import mix
    from torchneuron.hardware.chips import GPUS

    mm = {"ph": "X", "pid": 2, "cat": "tensor", "name": "aten::mm",
          "args": {"flops": 2 * 1024**3, "bytes": 6 * 2**20, "dtypes": ["torch.bfloat16", "torch.bfloat16"]}}
    add = {"ph": "X", "pid": 2, "cat": "vector", "name": "aten::add",
           "args": {"flops": 4 * 2**20, "bytes": 48 * 2**20, "dtypes": ["torch.float32"]}}
    host = {"ph": "X", "pid": 1, "cat": "host", "name": "aten::mm", "args": {}}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [mm, add, mm, add, host]}))
    ops = mix.load(path, steps=2)
    assert sorted((o.name, o.calls) for o in ops) == [("aten::add", 1), ("aten::mm", 1)]
    c = mix.price(ops, "trn2", execution="compiled")
    hbm = TRN2.hbm_bw / TRN2.logical_cores(LNC)
    kernel = 2 * TRN2.dma_fixed_s
    mm_s = max(2 * 1024**3 / (2 * 128 * 128 * 2.4e9 * LNC), 6 * 2**20 / hbm) + kernel
    add_s = max(4 * 2**20 / (TRN2.vector.rate(4) * LNC), 48 * 2**20 / hbm) + kernel
    assert c.step_s == pytest.approx(mm_s + add_s)
    assert c.mfu == pytest.approx(2 * 1024**3 / c.step_s / (83.4e12 * LNC))
    assert c.cost_per_hour == pytest.approx(35.7608 / 64)
    h = GPUS["h100"]
    g = mix.price(ops, "h100", execution="eager")
    fixed = h.launch_s + h.kernel_s
    gmm = max(2 * 1024**3 / (989e12 * 0.803), 6 * 2**20 / (3.35e12 * 0.906)) + fixed
    gadd = max(4 * 2**20 / 67e12, 48 * 2**20 / (3.35e12 * 0.906)) + fixed
    assert g.step_s == pytest.approx(gmm + gadd)
    fp32 = [dataclasses.replace(o, dtype="float32") if o.name == "aten::mm" else o for o in ops]
    c32 = mix.price(fp32, "trn2", execution="compiled")  # MFU over the fp32 dense peak, as estimate() divides
    assert c32.mfu == pytest.approx(2 * 1024**3 / c32.step_s / (22.6e12 * LNC))


def test_from_profile_cli_reads_a_real_profile(tmp_path, capsys):
    """A tiny GPT's forward on the neuron device under torchneuron.profiler, exported, then priced by the CLI:
    the mix keeps every recorded device op and its FLOPs."""
    import torchneuron
    from torchneuron.costmodel import mix
    from torchneuron.models import GPTConfig, TinyGPT, gpt_batch

    cfg = GPTConfig(n_layer=1, n_embd=64, n_head=2, block_size=32)
    x, y = gpt_batch(cfg, 2, torch.Generator().manual_seed(0))
    model = TinyGPT(cfg).to("neuron")
    with torchneuron.profiler.profile() as prof:
        model(x.to("neuron"), y.to("neuron"))
    trace_path = prof.export_chrome_trace(tmp_path / "t.json")
    from_file, from_object = mix.load(trace_path), mix.load(prof)
    assert sum(o.calls for o in from_object) == len(prof.events)
    assert sum(o.flops for o in from_file) == pytest.approx(sum(e.cost.flops for e in prof.events if e.device_s))
    p = argparse.ArgumentParser()
    cli.add_estimate_arguments(p)
    assert cli.run_estimate(p.parse_args(["--from-profile", str(trace_path), "--target", "trn1"])) == 0
    out = capsys.readouterr().out
    assert "1 trn1 of trn1.32xlarge" in out and "1 h100 of p5.48xlarge" in out and "compiled" in out


def test_moe_experts_cost_their_routed_tokens_and_read_only_the_hit_experts():
    """Mixtral (8 experts, 2 per token), 2 layers: a forward over 256 tokens runs its expert GEMMs on 512 routed
    rows: per layer 2 x 512 x 4096 x (2 x 14336) (gate and up) + 2 x 512 x 14336 x 4096 (down) FLOPs. A decode
    step at batch 1 routes 2 rows, so it reads 2 experts' weights, not 8 (bf16)."""
    model = presets.hf_model(presets.config("mixtral-8x7b", num_hidden_layers=2))
    n = sum(p.numel() for p in model.parameters())
    assert n == pytest.approx(2 * (8 * 3 * 4096 * 14336 + 4096 * (4096 + 2 * 1024 + 4096) + 8 * 4096)
                              + 2 * 32000 * 4096, rel=0.01)
    fwd = estimate(model, presets.lm_inputs(model, seq=256, mode="forward"), mode="forward", dtype=BF16,
                   compare=None, execution="eager")
    experts = [o for o in fwd.ops if o.op == "_grouped_mm"]
    assert sum(o.flops for o in experts) == pytest.approx(2 * (2 * 512 * 4096 * 2 * 14336 + 2 * 512 * 14336 * 4096))
    dec = estimate(model, presets.lm_inputs(model, mode="decode", context=64), mode="decode", dtype=BF16,
                   compare=None, execution="eager")
    read = sum(o.bytes for o in dec.ops if o.op == "_grouped_mm")
    assert read == pytest.approx(2 * 2 * 3 * 4096 * 14336 * 2, rel=0.01)
    assert 0 < fwd.mfu < 1 and fwd.mfu > 0.1  # the expert GEMMs count as model FLOPs


class _Experts(torch.nn.Module):
    """One grouped expert GEMM: rows grouped by expert (int32 end offsets) against [E, K, N] expert weights."""

    def __init__(self, e: int, k: int, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(e, k, n, dtype=BF16))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, self.w, offs=offs)


@pytest.mark.parametrize("rows", [2, 64])
@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_a_grouped_gemm_reads_only_the_experts_its_rows_hit_in_both_modes(rows, execution):
    """8 experts of 256 x 512 bf16: 2 rows of 256 bf16 values meet at most 2 experts, so the kernel moves the rows
    (rows x 256 x 2 bytes), 2 experts' weights (2 x 256 x 512 x 2), the output (rows x 512 x 2) and, as a compiled
    kernel's external input, the 8 int32 offsets (an eager op counts its GEMM operands); 64 rows reach all 8."""
    e, k, n = 8, 256, 512
    model = _Experts(e, k, n)
    x, offs = torch.empty(rows, k, dtype=BF16), torch.arange(1, e + 1, dtype=torch.int32) * rows // e
    r = estimate(model, (x, offs), target="trn2", mode="forward", compare=None, execution=execution)
    hit = min(e, rows)
    assert sum(o.bytes for o in r.ops if o.op == "_grouped_mm") == \
        pytest.approx(rows * k * 2 + hit * k * n * 2 + rows * n * 2 + (e * 4 if execution == "compiled" else 0))


def _pricing_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_estimate_arguments(p)
    a = p.parse_args(list(argv))
    cli.check_estimate_arguments(a, cli.usage_error)
    return a


def test_reserved_pricing_uses_the_published_ri_rate_and_no_gpu_side_without_one():
    """AWS publishes RI-effective rates for trn1 only (trn1.32xlarge $8.197/h) and none for a GPU instance: the
    GPU side of a reserved comparison is a usage error unless it is priced (--gpu-price) or dropped."""
    assert _pricing_args("--target", "trn1", "--pricing", "reserved", "--gpu", "none").price == pytest.approx(8.197)
    with pytest.raises(ValueError, match="no reserved rate is published for trn2.48xlarge"):
        _pricing_args("--target", "trn2", "--pricing", "reserved", "--gpu", "none")
    with pytest.raises(ValueError, match="no reserved rate is published for p5.48xlarge"):
        _pricing_args("--target", "trn1", "--pricing", "reserved")
    a = _pricing_args("--target", "trn1", "--pricing", "reserved", "--gpu-price", "30")
    assert (a.price, a.gpu_price, a.compare) == (pytest.approx(8.197), 30.0, "p5.48xlarge")


@pytest.mark.parametrize("gpu,instance,rate", [("h100", "p5.48xlarge", 39.33), ("h200", "p5e.48xlarge", 43.26)])
def test_capacity_block_pricing_prices_both_sides_at_the_published_block_rates(monkeypatch, gpu, instance, rate):
    """EC2 Capacity Blocks (S35): trn1.32xlarge $15.49/h, p5.48xlarge (8 x H100) $39.33/h, p5e.48xlarge (8 x H200)
    $43.26/h. Each side's $/M tokens is its rate pro rata for the cores used over its tokens per hour."""
    seen = {}

    def spy(*args, **kw):
        seen["r"] = r = estimate(*args, **kw)
        return r

    monkeypatch.setattr(cli, "estimate", spy)
    a = _pricing_args("--model", "gpt2-small", "--target", "trn1", "--mode", "decode", "--seq", "128", "--tp", "4",
                      "--pricing", "capacity-block", "--gpu", gpu, "--gpu-tp", "1", "--top", "0")
    assert (a.price, a.compare, a.gpu_price) == (pytest.approx(15.49), instance, pytest.approx(rate))
    assert cli.run_estimate(a) == 0
    r = seen["r"]
    c = r.comparison
    assert (r.instance, r.cores, c.instance, c.cores) == ("trn1.32xlarge", 4, instance, 1)
    assert r.cost_per_million == pytest.approx(15.49 * 4 / 32 / (3600 / r.step_time_s) * 1e6)
    assert c.cost_per_million == pytest.approx(rate * 1 / 8 / (3600 / c.step_time_s) * 1e6)


def test_capacity_block_pricing_is_a_usage_error_where_no_block_rate_is_published():
    """The Capacity Blocks page used (S35) lists no trn2, B200 or H100-on-p5en rate."""
    with pytest.raises(ValueError, match="no capacity-block rate is published for trn2.48xlarge"):
        _pricing_args("--target", "trn2", "--pricing", "capacity-block")
    with pytest.raises(ValueError, match="no capacity-block rate is published for p6-b200.48xlarge"):
        _pricing_args("--target", "trn1", "--pricing", "capacity-block", "--gpu", "b200")
    with pytest.raises(ValueError, match="no capacity-block rate is published for p5en.48xlarge"):
        _pricing_args("--target", "trn1", "--pricing", "capacity-block", "--compare", "p5en.48xlarge")
    a = _pricing_args("--target", "trn2", "--pricing", "capacity-block", "--price", "20", "--gpu-price", "50")
    assert (a.price, a.gpu_price, a.compare) == (20.0, 50.0, "p5.48xlarge")  # given rates stand; p5 by default


def _mixtral(layers: int = 2):
    model = presets.hf_model(presets.config("mixtral-8x7b", num_hidden_layers=layers))
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert expert == layers * 8 * 3 * 4096 * 14336  # gate, up and down of 8 experts per layer
    return model, expert, sum(p.numel() for p in model.parameters()) - expert


def test_expert_parallelism_dispatches_routed_tokens_with_all_to_alls():
    """Mixtral, 2 layers, a forward over 256 tokens on each of 8 trn2 cores with ep=8: every MoE layer sends its
    256 x 2 routed rows of 4096 bf16 values (4 MiB) to the experts' cores and back: 2 layers x 2 all-to-alls of
    58 us + one 1.5 us Mesh step + 7/8 of 4 MiB at 1024 GB/s / 4 cores x 0.295. A core holds 1 of the 8 experts:
    7/8 of the expert weights (2 bytes each) leave its memory, and a decode step at batch 1 reads 1 expert per
    layer there instead of the 2 the token is routed to."""
    model, expert, _ = _mixtral()
    kw = dict(target="trn2", dp=8, dtype=BF16, compare=None)
    fwd = {ep: estimate(model, presets.lm_inputs(model, seq=256, mode="forward"), mode="forward", ep=ep, **kw)
           for ep in (1, 8)}
    busbw = 1024e9 / 4 * 52.83 * 2**30 / 192e9
    nbytes = 256 * 2 * 4096 * 2
    assert fwd[8].by("op")["all_to_all"] == pytest.approx(4 * (58e-6 + 1.5e-6 + 7 / 8 * nbytes / busbw))
    assert "all_to_all" not in fwd[1].by("op")
    assert fwd[1].memory["weights"] - fwd[8].memory["weights"] == pytest.approx(expert * 2 * 7 / 8)
    dec = estimate(model, presets.lm_inputs(model, mode="decode", context=64), mode="decode", ep=8,
                   execution="eager", **kw)
    read = sum(o.bytes for o in dec.ops if o.op == "_grouped_mm")
    assert read == pytest.approx(2 * 1 * 3 * 4096 * 14336 * 2, rel=0.01)


@pytest.mark.parametrize("ep", [8, 4])
def test_expert_parallel_gradients_sync_over_the_replicas_holding_the_same_experts(ep):
    """Training on 8 cores: the dense parameters' gradients are all-reduced over all 8 (2 x 7/8 of their bf16
    bytes sent per core), the experts' over the 8 / ep replicas holding the same 8 / ep experts (none at ep=8);
    the backward adds 2 all-to-alls per layer for the gradients of the dispatched rows."""
    model, expert, dense = _mixtral()
    r = estimate(model, presets.lm_inputs(model, seq=128), target="trn2", dp=8, ep=ep, dtype=BF16, compare=None)
    sync = sum(o.bytes * o.count for o in r.ops if o.phase == "grad_sync")
    rest = 8 // ep
    assert sync == pytest.approx(2 * 7 / 8 * dense * 2 + 2 * (rest - 1) / rest * expert / ep * 2)
    assert sum(o.count for o in r.ops if o.op == "all_to_all") == 2 * 2 * 2  # layers x (dispatch, combine) x phases


def test_expert_parallel_degree_must_split_whole_experts_over_data_parallel_replicas():
    model, _, _ = _mixtral(1)
    inputs = presets.lm_inputs(model, seq=8, mode="forward")
    with pytest.raises(ValueError, match=r"ep=3 must divide the experts per layer \(8\)"):
        estimate(model, inputs, mode="forward", dp=6, ep=3, dtype=BF16, compare=None)
    with pytest.raises(ValueError, match="must divide the data-parallel degree"):
        estimate(model, inputs, mode="forward", dp=2, ep=4, dtype=BF16, compare=None)
    dense = _llama8b(1)
    with pytest.raises(ValueError, match="no _grouped_mm experts"):
        estimate(dense, presets.lm_inputs(dense, seq=8, mode="forward"), mode="forward", dp=2, ep=2, compare=None)


def test_cli_expert_parallel_degree_reaches_the_estimate(monkeypatch):
    seen = {}

    def spy(*args, **kw):
        seen.update(kw)
        return estimate(*args, **kw)

    monkeypatch.setattr(cli, "estimate", spy)
    p = argparse.ArgumentParser()
    cli.add_estimate_arguments(p)
    with pytest.raises(ValueError, match="--ep must divide --dp"):
        cli.check_estimate_arguments(p.parse_args(["--dp", "2", "--ep", "4"]), cli.usage_error)
    assert cli.run_estimate(p.parse_args(["--model", "mixtral-8x7b", "--mode", "decode", "--seq", "64", "--dp", "8",
                                          "--ep", "8", "--tp", "2", "--compare", "none", "--top", "0"])) == 0
    assert seen["ep"] == 8 and seen["dp"] == 8


def test_deepseek_v3_preset_has_the_published_size_and_serves_with_expert_parallelism():
    """DeepSeek-V3: 671B parameters, 37B activated per token (DeepSeek-V3 technical report); its 58 MoE layers hold
    256 routed experts of 3 x 7168 x 2048. Decoding one token at ep=64 (4 experts per core), each of its 8 routed
    rows meets an expert somewhere, and a core reads at most its 4 experts per layer: 4 x 3 x 7168 x 2048 bf16
    values per MoE layer (here 2 MoE layers after 1 dense one)."""
    full = presets.hf_model(presets.config("deepseek-v3"))
    n = sum(p.numel() for p in full.parameters())
    routed = sum(p.numel() for k, p in full.named_parameters() if ".experts." in k)
    assert routed == 58 * 256 * 3 * 7168 * 2048
    assert n == pytest.approx(671e9, rel=0.005)
    assert n - routed * (1 - 8 / 256) == pytest.approx(37e9, rel=0.02)
    model = presets.hf_model(presets.config("deepseek-v3", num_hidden_layers=3, first_k_dense_replace=1))
    r = estimate(model, presets.lm_inputs(model, mode="decode", context=128), target="trn2", mode="decode", dp=64,
                 ep=64, dtype=BF16, compare=None, execution="eager")
    read = sum(o.bytes for o in r.ops if o.op == "_grouped_mm")
    assert read == pytest.approx(2 * 4 * 3 * 7168 * 2048 * 2, rel=0.01)
    assert sum(o.count for o in r.ops if o.op == "all_to_all") == 2 * 2


@pytest.mark.parametrize("name, layers, total, active", [("qwen3-30b-a3b", 48, 30.5e9, 3.3e9),
                                                          ("qwen3-235b-a22b", 94, 235e9, 22e9)])
def test_qwen3_moe_presets_have_the_published_sizes(name, layers, total, active):
    """Qwen3 MoE (Qwen3 technical report / model cards: 30.5B parameters with 3.3B activated, 235B with 22B): every
    layer holds 128 experts of 3 x hidden x expert width and routes each token to 8 of them."""
    model = presets.hf_model(presets.config(name))
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for k, p in model.named_parameters() if ".experts." in k)
    assert routed == layers * 128 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert n == pytest.approx(total, rel=0.01)
    assert n - routed * (1 - 8 / 128) == pytest.approx(active, rel=0.02)


def test_search_tries_expert_parallelism_for_moe_models():
    """Serving a 2-layer Mixtral (8 experts): the search adds ep = 2, 4, 8 (dp = ep replicas, ep x tp cores in the
    instance); each such candidate is the estimate of its own layout, all-to-alls included; a dense model gets
    none."""
    from torchneuron.costmodel import search

    def build(batch):
        model = presets.hf_model(presets.config("mixtral-8x7b", num_hidden_layers=2))
        return model, presets.lm_inputs(model, mode="decode", context=256, batch=batch)

    cands = search.search(build, mode="decode", target="trn2", gpus=(), batches=(1,), latency_s=1.0)
    eps = {c.result.ep for c in cands}
    assert eps == {1, 2, 4, 8}
    c = next(c for c in cands if c.result.ep == 8 and c.result.tp == 4 and c.result.precision is None)
    assert "dp=8 ep=8" in c.layout and c.result.dp == 8
    model, inputs = build(1)
    direct = estimate(model, inputs, target="trn2", mode="decode", tp=4, dp=8, ep=8, dtype=BF16, compare=None)
    assert c.result.step_time_s == pytest.approx(direct.step_time_s)
    assert "all_to_all" in c.result.by("op")

    def dense(batch):
        model = _llama8b(layers=1)
        return model, presets.lm_inputs(model, mode="decode", context=256, batch=batch)

    assert {c.result.ep for c in search.search(dense, mode="decode", gpus=(), latency_s=1.0)} == {1}


def test_moe_serving_that_does_not_fit_names_the_expert_parallel_degree():
    """Mixtral-8x7B in bf16 on 8 trn2 cores (24 GiB each) as 8 replicas: 2 bytes x 46.7B parameters per core do
    not fit. Splitting the 8 experts over e replicas leaves 2 x (dense + experts / e) bytes and the cache (32 layers
    x K, V x 8 heads x 128 x 65 positions x 2 bytes): the smallest power of two that fits is what the error names,
    before 8-bit weights."""
    model, expert, dense = _mixtral(32)
    cache = 32 * 2 * 8 * 128 * 65 * 2
    e = next(e for e in (2, 4, 8) if 2 * (dense + expert / e) + cache <= CORE_HBM)
    assert e == 4
    with pytest.raises(torch.OutOfMemoryError, match=rf"the smallest change that fits: ep={e}$"):
        estimate(model, presets.lm_inputs(model, mode="decode", context=64), target="trn2", mode="decode", dp=8,
                 dtype=BF16, compare=None)


@pytest.mark.parametrize("rows, experts, tokens, decode, work", [
    (32768, 128, 4096, False, (191 * 512, 191)),  # Qwen3 context pass of 4,096 tokens x 8: ceil(32641 / 512) + 127
    (4096, 256, 512, False, (263 * 512, 263)),  # DeepSeek-V3, 512 tokens x 8 over 256 experts: 8 + 255 blocks
    (256, 128, 32, False, (32 * 128, 128)),  # fewer routed rows than a block: every token through every expert
    (128, 128, 16, True, (16 * 128, 128)),  # decode, 16 x 8 rows reach 128 experts: all experts, every token
    (64, 128, 8, True, (64, 64)),  # decode, 8 x 8 < 128: selective loading, each token its own 8 experts
])
def test_nxd_moe_work_follows_expert_mlps_v2(rows, experts, tokens, decode, work):
    """S49, ExpertMLPsV2.forward in inference with full capacity: selective loading below tokens x top-k = experts;
    all experts for decode and for a context pass under one 512-row block; else blockwise over
    ceil((rows - (E - 1)) / 512) + E - 1 blocks (at most rows), each one expert's 512 (padded) rows."""
    assert nxd_moe(rows, experts, tokens, decode) == work


def test_trainium_serving_costs_expert_gemms_as_nxd_runs_them():
    """One Qwen3-30B-A3B layer, a 4,096-token forward on one trn2 core (eager): its first expert GEMM (2048 ->
    2 x 768) runs NxD's 191 blocks of 512 rows (2.98x the 32,768 routed rows) and loads an expert's weights per
    block, but counts only the routed rows' FLOPs as the model's; on an H100 it is the grouped GEMM over the
    routed rows, reading each of the 128 experts once."""
    model = presets.hf_model(presets.config("qwen3-30b-a3b", num_hidden_layers=1))
    inputs = presets.lm_inputs(model, seq=4096, mode="forward")
    kw = dict(mode="forward", dtype=BF16, compare=None, execution="eager")
    trn, gpu = (estimate(model, inputs, target=t, **kw) for t in ("trn2", "h100"))
    for r, rows, loads in ((trn, 191 * 512, 191), (gpu, 32768, 128)):
        first = next(o for o in r.ops if o.op == "_grouped_mm")
        dense = op_cost("mm", [((rows, 2048), "bfloat16"), ((2048, 1536), "bfloat16")],
                        [((rows, 1536), "bfloat16")], r.target, mode="eager")
        assert first.flops == pytest.approx(2 * 32768 * 2048 * 1536)
        assert first.bytes == pytest.approx((rows * 2048 + loads * 2048 * 1536 + rows * 1536) * 2)
        assert first.time_s == pytest.approx(max(dense.compute_s, first.bytes / dense.peak_bw) + dense.overhead_s)


def test_trainium_moe_estimates_print_the_moe_caveat(capsys):
    """An MoE model estimated on Trainium prints the one-line caveat of the held-out MoE rows; the same model on a
    GPU and a dense model on Trainium do not."""
    model, _, _ = _mixtral(1)
    inputs = presets.lm_inputs(model, mode="decode", context=64)
    kw = dict(mode="decode", dtype=BF16, compare=None)
    assert validation.moe_caveat(estimate(model, inputs, target="trn2", **kw)) == validation.MOE_CAVEAT
    assert validation.moe_caveat(estimate(model, inputs, target="h100", **kw)) is None
    dense = _llama8b(1)
    assert validation.moe_caveat(estimate(dense, presets.lm_inputs(dense, mode="decode", context=64), **kw)) is None
    p = argparse.ArgumentParser()
    cli.add_estimate_arguments(p)
    assert cli.run_estimate(p.parse_args(["--model", "mixtral-8x7b", "--mode", "decode", "--seq", "64", "--tp", "8",
                                          "--compare", "none", "--top", "0"])) == 0
    assert validation.MOE_CAVEAT in capsys.readouterr().out


_SMALL_MOE = dict(num_hidden_layers=2, hidden_size=256, moe_intermediate_size=96, num_experts=8,
                  num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=1024)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("target", ["trn2", "h100"])
def test_moe_layers_are_split_as_nxd_and_megatron_split_them(tp, target):
    """NxD (S49, routing.py: the router an unsplit nn.Linear), Megatron and vLLM under tensor parallelism: the router
    is replicated, each expert's gate/up GEMM column-parallel (2 x 96 / tp output columns per core), its down GEMM
    row-parallel (96 / tp contraction rows), and the layer ends in one all-reduce of [tokens, hidden], none on the
    router's [tokens, experts]. A 2-layer Qwen3-MoE forward over 64 tokens: 2 x (attention + MoE) + the
    vocab-parallel embedding = 5 all-reduces of 64 x 256 bf16 values (32 KiB), whatever the TP degree."""
    model = presets.hf_model(presets.config("qwen3-30b-a3b", **_SMALL_MOE))
    inputs = presets.lm_inputs(model, seq=64, mode="forward")
    tr = trace(model, inputs, train=False, dtype=BF16)
    assert [r.ins[0].nbytes for r in tr.recs if r.op == "all_reduce"] == [64 * 256 * 2] * 5
    router = [r for r in tr.recs if r.op == "mm" and r.outs[0].shape == (64, 8)]
    experts = [r for r in tr.recs if r.op == "_grouped_mm"]
    assert len(router) == 2 and all(r.shard is None for r in router)  # every core routes every token
    assert [(r.ins[1].shape, r.shard) for r in experts] == [((8, 256, 192), "n"), ((8, 96, 256), "k")] * 2
    r = estimate(model, inputs, target=target, mode="forward", tp=tp, dtype=BF16, compare=None, execution="eager")
    assert sum(o.engine == "collective" for o in r.ops) == 5
    flops = [o.flops for o in r.ops if o.op == "_grouped_mm"]
    assert flops == [2 * 128 * 256 * 192 / tp, 2 * 128 * 96 * 256 / tp] * 2  # 64 tokens x 2 experts = 128 rows


_SMALL_DEEPSEEK = dict(num_hidden_layers=2, first_k_dense_replace=1, hidden_size=256, intermediate_size=384,
                       moe_intermediate_size=96, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                       num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                       qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, vocab_size=1024)


def test_a_router_whose_weight_is_cast_is_replicated_too():
    """DeepSeek-V3's router casts its weight to float32 before the matmul (Hugging Face DeepseekV3TopkRouter): the
    weight behind the cast is what stays unsplit, so the [tokens, experts] logits are whole on every core and the
    expert GEMMs are column- then row-parallel."""
    model = presets.hf_model(presets.config("deepseek-v3", **_SMALL_DEEPSEEK))
    tr = trace(model, presets.lm_inputs(model, seq=64, mode="forward"), train=False, dtype=BF16)
    router = [r for r in tr.recs if r.op == "mm" and r.outs[0].shape == (64, 8)]
    assert len(router) == 1 and router[0].outs[0].dtype == "float32" and router[0].shard is None
    assert [r.shard for r in tr.recs if r.op == "_grouped_mm"] == ["n", "k"]
    assert not any(r.op == "all_reduce" and 8 in r.ins[0].shape for r in tr.recs)


def test_moe_training_reduces_layer_gradients_not_routed_rows():
    """The backward of the same 2-layer model over 64 tokens, as Megatron's: each block's input gradient is reduced
    once, 2 x 2 + 1 all-reduces of [64, 256] as in a dense model; the rest are the routing weights' gradients
    ([64 x 2] values) and norm weights' ([256]), never the routed rows [128, 256] or [128, 2 x 96]."""
    model = presets.hf_model(presets.config("qwen3-30b-a3b", **_SMALL_MOE))
    tr = trace(model, presets.lm_inputs(model, seq=64, mode="train"), train=True, dtype=BF16)
    sizes = [r.ins[0].numel for r in tr.recs if r.op == "all_reduce" and r.phase == "backward"]
    assert sizes.count(64 * 256) == 5
    assert all(n <= 256 for n in sizes if n != 64 * 256)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("target", ["trn2", "h100"])
@pytest.mark.parametrize("mode", ["forward", "decode"])
def test_latent_attention_is_split_as_vllm_and_megatron_split_it(tp, target, mode):
    """vLLM's DeepseekV2Attention (vllm/model_executor/models/deepseek_v2.py) and Megatron's MLASelfAttention under
    tensor parallelism: q_a_proj and kv_a_proj_with_mqa are replicated (every core computes the 64- and 32 + 16-wide
    latents and their norms), q_b_proj and kv_b_proj column-parallel by heads, o_proj row-parallel. A 2-layer
    DeepSeek-V3 (one dense, one MoE layer) over `tokens` tokens then has 2 x (attention + MLP or MoE) + the
    vocab-parallel embedding = 5 all-reduces of [tokens, 256] bf16, whatever the TP degree: none of the latent or
    of the re-expanded keys and values."""
    model = presets.hf_model(presets.config("deepseek-v3", **_SMALL_DEEPSEEK))
    tokens = 64 if mode == "forward" else 1
    inputs = presets.lm_inputs(model, seq=64, mode="forward") if mode == "forward" else \
        presets.lm_inputs(model, seq=1, mode="decode", context=63)
    tr = trace(model, inputs, train=False, dtype=BF16)
    assert [r.ins[0].nbytes for r in tr.recs if r.op == "all_reduce"] == [tokens * 256 * 2] * 5
    shards = {r.ins[1].shape: r.shard for r in tr.recs if r.op == "mm"}
    assert shards[(256, 64)] is None and shards[(256, 48)] is None  # q_a_proj, kv_a_proj_with_mqa: replicated
    assert shards[(64, 192)] == "n" and shards[(32, 256)] == "n"  # q_b_proj, kv_b_proj: 4 heads split
    assert shards[(128, 256)] == "k"  # o_proj
    r = estimate(model, inputs, target=target, mode=mode, tp=tp, dtype=BF16, compare=None, execution="eager")
    assert sum(o.engine == "collective" for o in r.ops) == 5
    q_b = [o.flops for o in r.ops if o.op == "mm" and o.flops == 2 * tokens * 64 * 192 / tp]
    assert len(q_b) == 2  # each layer's query up-projection: 1/tp of its heads per core


def test_a_layer_after_a_moe_layer_keeps_its_projections_split():
    """Low-rank down-projections are looked for only once the routers are replicated: with the router split, the
    layer after an MoE layer saw a sharded input, and the walk up from its q_proj through the norm took the router
    (narrower, normed on the way) for a down-projection. Mixtral-8x7B prefill over 128 tokens: 32 x (attention + MoE)
    + the vocab-parallel embedding = 65 all-reduces of 128 x 4,096 bf16 values, and no replicated projection."""
    model, inputs = presets.load("mixtral-8x7b", seq=128, mode="forward")
    tr = trace(model, inputs, train=False, dtype=BF16)
    assert [r.ins[0].nbytes for r in tr.recs if r.op == "all_reduce"] == [128 * 4096 * 2] * 65
    assert all(r.shard is not None for r in tr.recs if r.op == "mm" and r.ins[1].shape[1] != 8)  # all but routers


def test_plan_arguments_name_themselves_and_take_any_integer_type():
    """A bad argument is named with its value (a usage error at the CLI); a numpy integer is an integer, a bool is
    not one."""
    import numpy as np

    from torchneuron.costmodel.estimate import EstimateError, Plan

    assert Plan(dp=np.int64(4), tp=np.int32(2)).dp == 4
    for kw, needle in ((dict(dp=True), "dp=True: expected an integer >= 1"), (dict(tp=0), "tp=0"),
                       (dict(mode="prefill"), "mode='prefill': expected one of"),
                       (dict(batch_items=-5), "batch_tokens=-5: expected a number > 0")):
        with pytest.raises(EstimateError, match=needle):
            Plan(**kw)
