"""torchneuron.estimate: a step is the sum of its ops; large models from configs cost no memory or time."""
from __future__ import annotations

import pytest
import torch

import torchneuron
from torchneuron.costmodel import presets
from torchneuron.costmodel.estimate import estimate
from torchneuron.hardware.chips import CHIPS
from torchneuron.models import GPTConfig, TinyGPT, gpt_batch


@pytest.fixture(scope="module")
def gpt():
    cfg = GPTConfig(n_layer=2, n_embd=128, n_head=4, block_size=64)
    x, y = gpt_batch(cfg, 8, torch.Generator().manual_seed(0))
    return TinyGPT(cfg), (x, y)


@pytest.mark.parametrize("mode", ["train", "forward"])
@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_small_gpt_step_is_the_sum_of_its_op_times(gpt, mode, execution):
    model, inputs = gpt
    r = estimate(model, inputs, target="trn2", mode=mode, execution=execution)
    assert r.step_time_s == pytest.approx(sum(o.time_s * o.count for o in r.ops))
    assert r.step_time_s == pytest.approx(sum(r.by("phase").values()))
    assert r.items_per_step == 8 * 64 and r.unit == "tokens"
    assert r.items_per_s == pytest.approx(r.items_per_step / r.step_time_s)
    assert 0 < r.mfu < 1
    phases = set(r.by("phase"))
    assert phases == ({"forward", "backward", "optimizer"} if mode == "train" else {"forward"})
    engines = {o.engine for o in r.ops}
    assert {"tensor", "vector"} <= engines
    assert r.cost_per_hour == pytest.approx(35.7608 / 64)  # one trn2 logical core, pro rata
    assert r.cost_per_million == pytest.approx(r.cost_per_hour / (r.items_per_s * 3600) * 1e6)
    assert model.training  # the user's model is left as it was


def test_eager_pays_a_launch_per_op(gpt):
    model, inputs = gpt
    eager = estimate(model, inputs, mode="forward", execution="eager", compare=None)
    compiled = estimate(model, inputs, mode="forward", compare=None)
    kernels = sum(1 for o in eager.ops if o.engine not in ("none", "free"))
    assert eager.step_time_s > compiled.step_time_s + kernels * 30e-6 * 0.9


def test_comparison_uses_the_same_trace_on_an_h100(gpt):
    model, inputs = gpt
    r = estimate(model, inputs, target="trn2", mode="forward")
    c = r.comparison
    assert c.target == "h100" and c.instance == "p5.48xlarge" and c.cores == 1
    assert c.cost_per_hour == pytest.approx(55.04 / 8)
    assert {o.op for o in c.ops} == {o.op for o in r.ops}
    assert "h100 GPU" in c.summary()


# ---- one-op models against rooflines computed here from the chip's published numbers (hardware/chips.py) ----

TRN2, LNC = CHIPS["trn2"], 2  # a trn2 logical core is two physical cores
HBM_BW = TRN2.hbm_bw / TRN2.logical_cores(LNC)  # its share of the chip's HBM bandwidth
TOL = 0.03  # the model adds per-kernel DMA fixed costs and instruction overheads (a few us) to the roofline


class Matmul(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(n, n))

    def forward(self, x):
        return x @ self.w


class Axpy(torch.nn.Module):
    def forward(self, x):
        return x + 2 * x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("execution", ["eager", "compiled"])
def test_matmul_is_its_compute_roofline(dtype, execution):
    """[4096,4096] @ [4096,4096]: 2n^3 FLOPs at the array's rate (2 FLOP/PE/cycle, a quarter for fp32) on two
    physical cores, compute bound (n^2 x 3 x itemsize bytes take a sixth of that), plus one launch."""
    n = 4096
    with torch.device("meta"):
        model, x = Matmul(n), torch.empty(n, n)
    r = estimate(model, (x,), target="trn2", mode="forward", execution=execution, dtype=dtype, compare=None)
    peak = LNC * TRN2.tensor_flops("float32" if dtype == torch.float32 else "bfloat16")
    compute, memory = 2 * n**3 / peak, 3 * n * n * dtype.itemsize / HBM_BW
    assert memory < compute / 6
    assert r.step_time_s == pytest.approx(compute + TRN2.launch_s, rel=TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_elementwise_is_its_memory_roofline(dtype):
    """Eager `x + 2 * x` on 16M elements: two kernels, each reading its inputs and writing its output from HBM
    (2 then 3 tensors), memory bound, plus a launch each."""
    n = 4096 * 4096
    with torch.device("meta"):
        x = torch.empty(4096, 4096)
    r = estimate(Axpy(), (x,), target="trn2", mode="forward", execution="eager", dtype=dtype, compare=None)
    vector = LNC * TRN2.vector.rate(dtype.itemsize)
    assert 2 * n / vector < 5 * n * dtype.itemsize / HBM_BW  # the vector engine outruns HBM
    assert r.step_time_s == pytest.approx(5 * n * dtype.itemsize / HBM_BW + 2 * TRN2.launch_s, rel=TOL)


@pytest.mark.parametrize("dp", [2, 4])
def test_gradient_all_reduce_is_its_bandwidth_roofline(dp):
    """The gradient sync of a [4096,4096] fp32 weight over `dp` cores of one instance: a ring all-reduce moves
    2(dp-1)/dp of the buffer per rank at the NeuronLink share of a core times the measured efficiency, after the
    fixed collective latency (each hop adds 1.5 us)."""
    n = 4096
    with torch.device("meta"):
        model, x = Matmul(n), torch.empty(n, n)
    r = estimate(model, (x,), target="trn2", mode="train", dp=dp, optimizer="sgd", compare=None)
    busbw = TRN2.link_bw / TRN2.logical_cores(LNC) * TRN2.fabric.efficiency
    nbytes = n * n * 4
    assert r.by("phase")["grad_sync"] == pytest.approx(
        TRN2.fabric.fixed_s + 2 * (dp - 1) / dp * nbytes / busbw, rel=TOL)


def test_top_level_lazy_api():
    assert torchneuron.estimate is estimate


def _llama(name: str, layers: int | None = None):
    overrides = {"num_hidden_layers": layers} if layers else {}
    model = presets.hf_model(presets.config(name, **overrides))
    assert all(p.is_meta for p in model.parameters())  # no weights, no memory
    return model


def test_llama_8b_training_estimate():
    model = _llama("llama-8b")
    r = estimate(model, presets.lm_inputs(model, seq=2048), target="trn2", tp=8, dp=8, dtype=torch.bfloat16,
                 batch_tokens=512 * 2048)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(8.03e9, rel=0.01)
    assert r.micro_steps == 64 and r.items_per_step == 512 * 2048
    assert 0.1 < r.mfu < 1
    assert r.fits and r.memory["weights"] == pytest.approx(8.03e9 * 2 / 8, rel=0.01)
    assert r.by("phase")["grad_sync"] > 0
    assert any(o.engine == "collective" and o.phase == "forward" for o in r.ops)


def test_llama_70b_estimates():
    model = _llama("llama-70b")
    bf16 = torch.bfloat16
    train = estimate(model, presets.lm_inputs(model, seq=1024), tp=32, dp=2, dtype=bf16, compare=None)
    decode = estimate(model, presets.lm_inputs(model, mode="decode", context=2048), mode="decode", tp=64,
                      dtype=bf16, compare=None)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(70.6e9, rel=0.01)
    assert 0 < train.mfu < 1 and decode.unit == "tokens" and decode.items_per_step == 1  # below the roofline
    # decode reads every weight once per token: at least the HBM time of 1/64 of 141 GB at 725 GB/s per core
    assert decode.step_time_s > 70.6e9 * 2 / 64 / 725e9


def test_tensor_parallel_splits_matmuls_and_adds_two_reductions_per_layer():
    model = _llama("llama-8b", layers=2)
    inputs = presets.lm_inputs(model, seq=512, mode="forward")
    one = estimate(model, inputs, mode="forward", dtype=torch.bfloat16, compare=None)
    four = estimate(model, inputs, mode="forward", tp=4, dtype=torch.bfloat16, compare=None)
    mm = lambda r: sum(o.flops for o in r.ops if o.op == "mm")
    assert mm(four) == pytest.approx(mm(one) / 4)
    # column-parallel q/k/v and gate/up need nothing; row-parallel o_proj and down_proj each need one
    # all-reduce; so does the vocab-parallel embedding
    assert sum(1 for o in four.ops if o.engine == "collective") == 2 * 2 + 1
    assert not any(o.engine == "collective" for o in one.ops)


def test_decode_time_grows_with_the_cache():
    model = _llama("llama-8b", layers=2)
    t = [estimate(model, presets.lm_inputs(model, mode="decode", context=n), mode="decode", tp=8,
                  dtype=torch.bfloat16, compare=None).step_time_s for n in (1024, 65536)]
    assert t[1] > t[0]


def test_hugging_face_gpt2_from_a_small_config():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=256))
    ids = torch.zeros(2, 128, dtype=torch.long)
    r = estimate(model, {"input_ids": ids, "labels": ids}, target="trn1")
    assert r.items_per_step == 256 and 0 < r.mfu < 1  # the step takes at least its FLOPs at peak
    assert {"nll_loss_forward", "nll_loss_backward"} <= {o.op for o in r.ops}
    assert r.comparison is not None and r.comparison.step_time_s > 0


def test_bad_arguments_are_errors(gpt):
    model, inputs = gpt
    with pytest.raises(ValueError):
        estimate(model, inputs, mode="serve")
    with pytest.raises(ValueError):
        estimate(model, inputs, target="trn2", instance="trn1.32xlarge")
    with pytest.raises(ValueError, match=r"must be in 1\.\.64 \(the trn2 cores of one trn2.48xlarge\), got 1000"):
        estimate(model, inputs, tp=1000)  # TP groups stay inside one instance
    for price in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="finite number > 0"):
            estimate(model, inputs, price_per_hour=price)


def test_cli_estimate_from_a_file_function_writes_a_report(tmp_path, capsys):
    import argparse

    from torchneuron.costmodel import cli

    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "from torchneuron.models import GPTConfig, TinyGPT\n"
        "def build(batch, seq, mode):\n"
        "    ids = torch.zeros(batch, seq, dtype=torch.long)\n"
        "    return TinyGPT(GPTConfig(block_size=seq)), (ids, ids)\n")
    p = argparse.ArgumentParser()
    cli.add_estimate_arguments(p)
    report = tmp_path / "out.md"
    args = p.parse_args(["--model", f"{tmp_path / 'mymodel.py'}:build", "--batch", "4", "--seq", "64",
                         "--target", "trn1", "--report", str(report)])
    assert cli.run_estimate(args) == 0
    out = capsys.readouterr().out
    assert "training step on 1 x trn1 core" in out and "h100 GPU" in out and "top ops" in out
    text = report.read_text()
    assert "| tokens / s |" in text and "![roofline](out.roofline.png)" in text
    assert (tmp_path / "out.time.png").stat().st_size > 10_000
    assert (tmp_path / "out.roofline.png").stat().st_size > 10_000


def test_demo_text_compares_trn2_with_an_h100(gpt):
    from torchneuron.costmodel.cli import demo_estimate_text

    model, inputs = gpt
    text = demo_estimate_text(model, inputs)
    assert "trn2 NeuronCore" in text and "h100 GPU" in text and "per million tokens" in text


def test_html_report_embeds_both_charts(gpt, tmp_path):
    from torchneuron.costmodel import report

    model, inputs = gpt
    r = estimate(model, inputs, target="trn2")
    (page,) = report.write(r, tmp_path / "gpt.html", "TinyGPT")
    html = page.read_text()
    assert html.count('src="data:image/png;base64,') == 2
    assert "TinyGPT: training step" in html and "p5.48xlarge" in html
    assert list(tmp_path.iterdir()) == [page]  # nothing left beside it
