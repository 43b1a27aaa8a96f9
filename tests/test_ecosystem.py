"""The ecosystem finds `neuron`: AWS's torch_neuronx names and variables, transformers, accelerate, Lightning.

Real libraries, tiny random-weight models built from configs, no downloads. References are CPU runs of the same
code with the same seed; the multi-process runs check the device, backend and precision every rank reports and
that DDP kept the ranks' weights identical.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import run_py
from dist_helpers import free_port
from helpers import clean_env

import torchneuron
from torchneuron.hardware import config

REPO = Path(__file__).resolve().parents[1]


# A child's environment: no device or Accelerate configuration, this tree importable, the Hugging Face hub offline.
_env = functools.partial(clean_env, ("ACCELERATE_",), PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get(
    "PYTHONPATH", "")]), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def _results(out: str) -> list[dict]:
    return sorted((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")),
                  key=lambda r: r["rank"])


# ---------------------------------------------------------------------------------------------- AWS's names


def test_torch_neuronx_maps_aws_names_onto_ours():
    import torch_neuronx

    assert torch_neuronx.get_fallback_ops is torchneuron.get_fallback_ops
    assert torch_neuronx.clear_op_tracking is torchneuron.clear_op_tracking
    for name in ("memory_allocated", "max_memory_allocated", "memory_stats", "empty_cache", "get_dynamo_metrics",
                 "synchronize", "device_count"):
        assert getattr(torch_neuronx, name) is getattr(torch.neuron, name)
    x = torch.ones(4, device="neuron").exp()
    assert torch_neuronx.get_executed_ops().get("aten::exp") == 1 and x.device.type == "neuron"
    assert torch_neuronx.memory_allocated() == torch.neuron.memory_allocated() > 0


@pytest.mark.parametrize("name, hint", [("trace", "torch.compile"), ("DataParallel", "DistributedDataParallel"),
                                        ("neuron_dynamo_backend", "model_name")])
def test_torch_neuronx_names_we_do_not_provide_say_what_to_use(name, hint):
    import torch_neuronx

    with pytest.raises(AttributeError, match=f"torch_neuronx.{name} is not provided.*{hint}"):
        getattr(torch_neuronx, name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'.*torch.neuron"):
        torch_neuronx.no_such_name  # noqa: B018


def test_aws_variables_are_aliases_of_ours(monkeypatch):
    from torchneuron.compiler import cache
    from torchneuron.compiler.backend import Options

    aws = {"TORCH_NEURONX_DEBUG_DIR": "/tmp/d", "NEURON_RT_NUM_CORES": "2",
           "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "0"}
    env = config.with_aliases(aws)
    assert env["TORCHNEURON_DEBUG_DIR"] == "/tmp/d" and env["TORCHNEURON_COMPILE_FALLBACK"] == "eager"
    assert config.load(aws).device_count == 2 and config.load({"NEURON_RT_NUM_CORES": "3"}).visible_cores == (0, 1, 2)
    # the places that read them: compile cache, compile fallback, debug dir
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", "/tmp/aws-cache")
    assert cache.root() == Path("/tmp/aws-cache")
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "0")
    assert Options.parse(None, None).fallback == "eager"
    monkeypatch.setenv("TORCHNEURON_COMPILE_FALLBACK", "error")  # ours wins, and the disagreement is said
    config._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="TORCHNEURON_COMPILE_FALLBACK='error' and AWS's"):
        assert Options.parse(None, None).fallback == "error"
    with pytest.raises(config.ConfigError, match="TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION='maybe'"):
        config.with_aliases({"TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "maybe"})
    with pytest.raises(config.ConfigError, match="'0-8' names cores .4, 5, 6, 7, 8.*logical cores 0-3"):
        config.load({"NEURON_RT_NUM_CORES": "9"})  # trn2.3xlarge has 4 logical cores
    with pytest.raises(config.ConfigError, match="NEURON_RT_NUM_CORES='two'"):
        config.load({"NEURON_RT_NUM_CORES": "two"})


def test_stands_down_when_aws_torch_neuronx_is_installed(tmp_path):
    """A fake AWS distribution (metadata + a torch.compile entry point): ours registers nothing, refuses to be
    imported as torch_neuronx, and hands torch.compile(backend="neuron") to AWS's backend."""
    info = tmp_path / "torch_neuronx-2.33.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-neuronx\nVersion: 2.33.0\n")
    (info / "entry_points.txt").write_text("[torch_dynamo_backends]\nneuron = fake_aws:backend\n")
    (tmp_path / "fake_aws.py").write_text("CALLS = []\ndef backend(gm, inputs, **kw):\n"
                                          "    CALLS.append(len(inputs))\n    return gm.forward\n")
    code = """
        import warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import torch
        assert any("stands down" in str(x.message) for x in w), [str(x.message) for x in w]
        assert not hasattr(torch, "neuron") and torch._C._get_privateuse1_backend_name() == "privateuseone"
        try:
            import torch_neuronx
            raise SystemExit("imported")
        except ImportError as e:
            assert "torch-neuronx 2.33.0 is installed" in str(e), e
        import fake_aws
        from torchneuron.compiler.backend import neuron_backend
        f = torch.compile(lambda x: x * 2, backend=neuron_backend)
        assert f(torch.ones(3)).tolist() == [2.0, 2.0, 2.0] and fake_aws.CALLS == [1], fake_aws.CALLS
        print("OK")
    """
    p = run_py(code, _env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])))
    assert "OK" in p.stdout


def test_import_torch_stays_light():
    code = """
        import sys, torch
        heavy = sorted({m.split(".")[0] for m in sys.modules} & {"transformers", "accelerate", "lightning",
                       "pytorch_lightning", "lightning_fabric", "torch_neuronx"})
        assert not heavy and torch.neuron.is_available(), heavy
        assert any(type(f).__name__ == "ImportHook" for f in sys.meta_path)
    """
    run_py(code, _env())


# ---------------------------------------------------------------------------------------------- Hugging Face

_TRAINER = """
import json, sys, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randint(0, 64, (24, 8), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}

def run(use_cpu, compile):
    set_seed(0)
    # no dropout: with it each device draws masks from its own generator (as CUDA does), so losses differ
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    args = TrainingArguments(output_dir=sys.argv[1], max_steps=6, per_device_train_batch_size=4, logging_steps=1,
                             report_to=[], use_cpu=use_cpu, torch_compile=compile, save_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Data())
    trainer.train()
    return {"device": str(args.device), "backend": args.torch_compile_backend,
            "param_device": str(next(trainer.model.parameters()).device),
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}

compile = sys.argv[2] == "compile"
neuron = run(False, compile)
neuron["graphs"] = len(torch.neuron.get_dynamo_metrics())
print("RESULT " + json.dumps({"rank": 0, "neuron": neuron, "cpu": run(True, False)}))
"""


def _trainer(tmp_path: Path, mode: str) -> dict:
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), mode], capture_output=True, text=True,
                       env=_env(), timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return _results(p.stdout)[0]


def test_trainer_defaults_to_neuron_and_matches_cpu(tmp_path):
    r = _trainer(tmp_path, "eager")
    assert r["neuron"]["device"] == "neuron:0" and r["neuron"]["param_device"] == "neuron:0"
    assert r["cpu"]["device"] == "cpu" and len(r["neuron"]["losses"]) == 6
    assert r["neuron"]["losses"] == pytest.approx(r["cpu"]["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_trainer_torch_compile_uses_the_neuron_backend(tmp_path):
    r = _trainer(tmp_path, "compile")
    assert r["neuron"]["backend"] == "neuron" and r["neuron"]["graphs"] >= 1
    assert r["neuron"]["losses"] == pytest.approx(r["cpu"]["losses"], rel=1e-4, abs=1e-5)


def test_accelerator_and_accelerate_config_default_pick_neuron(tmp_path):
    cfg = tmp_path / "default_config.yaml"
    code = f"""
        from accelerate import Accelerator
        from accelerate.utils import DistributedType
        a = Accelerator()
        assert str(a.device) == "neuron" and a.distributed_type == DistributedType.NO, (a.device, a.distributed_type)
        import sys
        from accelerate.commands.accelerate_cli import main
        sys.argv = ["accelerate", "config", "default", "--config_file", {str(cfg)!r}]
        main()
    """
    run_py(code, _env())
    written = json.loads(cfg.read_text())
    assert written["distributed_type"] == "MULTI_NEURON" and written["num_processes"] == 4, written


_ACCELERATE = """
import json, os, torch
from accelerate import Accelerator
from accelerate.utils import set_seed

acc = Accelerator()
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
first = model[0].weight.detach().clone()
seen = []
model[0].register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
w = acc.unwrap_model(model)[0].weight.detach()
ws = acc.gather(w[None])
r = {"rank": acc.process_index, "device": str(acc.device), "type": str(acc.distributed_type),
     "backend": torch.distributed.get_backend(), "autocast": seen[0], "x": str(x.device),
     "same": bool(torch.equal(ws[0], ws[1])), "trained": not torch.equal(w.cpu(), first)}
os.write(1, ("RESULT " + json.dumps(r) + "\\n").encode())  # one write: the ranks share stdout
"""


@pytest.mark.slow
def test_accelerate_launch_two_processes_bf16(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_ACCELERATE)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--mixed_precision", "bf16",
           "--main_process_port", str(free_port()), str(script)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    results = _results(p.stdout)
    assert [r["device"] for r in results] == ["neuron:0", "neuron:1"]
    for r in results:
        assert r["type"] == "DistributedType.MULTI_NEURON" and r["backend"] == "neuron" and r["x"] == r["device"]
        assert r["autocast"] == "torch.bfloat16" and r["same"] and r["trained"]


# ---------------------------------------------------------------------------------------------- Lightning

_LIGHTNING = """
import json, os, sys, torch
pl = __import__(sys.argv[1], fromlist=["LightningModule"])

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.losses, self.seen = [], set()
    def training_step(self, batch, i):
        x, y = batch
        out = self.net(x)
        self.seen.add((str(x.device), str(out.dtype)))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        self.losses.append(loss.item())
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def fit(accelerator, devices, precision):
    torch.manual_seed(0)
    model = Tiny()
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, precision=precision, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    w = model.net[0].weight.detach().to(trainer.strategy.root_device)
    ws = trainer.strategy.all_gather(w)
    return {"rank": trainer.global_rank, "strategy": type(trainer.strategy).__name__, "losses": model.losses,
            "device": str(trainer.strategy.root_device), "seen": sorted(model.seen),
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "same": bool(ws.ndim == 2 or torch.equal(ws[0], ws[-1]))}

for run in sys.argv[2:]:  # accelerator:devices:precision
    accelerator, devices, precision = run.split(":")
    os.write(1, ("RESULT " + json.dumps(fit(accelerator, int(devices), precision)) + "\\n").encode())  # one write
"""


def _lightning(tmp_path: Path, *args: str) -> list[dict]:
    script = tmp_path / "fit.py"
    script.write_text(_LIGHTNING)
    p = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=_env(),
                       timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]


def test_lightning_trainer_on_neuron_matches_cpu(tmp_path):
    """accelerator="neuron" with only lightning and torch imported; "auto" picks it too."""
    neuron, auto, cpu = _lightning(tmp_path, "lightning.pytorch", "neuron:1:32-true", "auto:1:32-true", "cpu:1:32-true")
    assert neuron["device"] == auto["device"] == "neuron:0" and neuron["seen"] == [["neuron:0", "torch.float32"]]
    assert neuron["strategy"] == "SingleDeviceStrategy" and cpu["seen"] == [["cpu", "torch.float32"]]
    assert neuron["losses"] == pytest.approx(cpu["losses"], rel=1e-6) and neuron["losses"] == auto["losses"]


def test_pytorch_lightning_bf16_mixed_on_neuron(tmp_path):
    r, = _lightning(tmp_path, "pytorch_lightning", "neuron:1:bf16-mixed")
    assert r["device"] == "neuron:0" and r["seen"] == [["neuron:0", "torch.bfloat16"]]


@pytest.mark.slow
def test_lightning_ddp_two_neuron_devices(tmp_path):
    results = sorted(_lightning(tmp_path, "lightning.pytorch", "neuron:2:bf16-mixed"), key=lambda r: r["rank"])
    assert [r["device"] for r in results] == ["neuron:0", "neuron:1"]
    for r in results:
        assert r["strategy"] == "DDPStrategy" and r["backend"] == "neuron" and r["same"]
        assert r["seen"] == [[r["device"], "torch.bfloat16"]]


def test_lightning_patch_is_undone_and_redone():
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from torchneuron import integrations

    assert "neuron" in AcceleratorRegistry and _AcceleratorConnector._choose_auto_accelerator() == "neuron"
    integrations.uninstall()
    try:
        assert "neuron" not in AcceleratorRegistry and _AcceleratorConnector._choose_auto_accelerator() == "cpu"
        assert integrations._HOOK not in sys.meta_path
    finally:
        integrations.install()
    assert "neuron" in AcceleratorRegistry and _AcceleratorConnector._choose_auto_accelerator() == "neuron"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = AcceleratorRegistry.get("neuron")
    assert acc.get_parallel_devices(2) == [torch.device("neuron", 0), torch.device("neuron", 1)]
    with pytest.raises(ValueError, match="sees 4 neuron device"):
        acc.parse_devices(5)


def test_lightning_fabric_selects_neuron():
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="neuron", devices=1, precision="16-mixed")
    assert fabric.device == torch.device("neuron", 0) and fabric._precision.device == "neuron"
    assert fabric._precision.scaler is not None  # fp16 gets a GradScaler, on neuron
    assert Fabric(accelerator="auto", devices=1).device == torch.device("neuron", 0)
    linear, seen = torch.nn.Linear(4, 2), []
    linear.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model = fabric.setup(linear)
    model(torch.ones(1, 4, device=fabric.device))  # Fabric converts the output back to fp32
    assert seen == [torch.float16] and linear.weight.device == fabric.device


def test_info_lists_the_integrations(capsys):
    from torchneuron.cli import main

    assert main(["info", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    libs = {i["library"]: i for i in facts["integrations"]}
    for name in ("torch_neuronx", "transformers", "accelerate", "lightning", "pytorch_lightning"):
        assert libs[name]["sees_neuron"] and libs[name]["version"], libs[name]


def test_module_cpu_after_ddp_keeps_its_parameters(tmp_path):
    """accelerate's test script does `accelerator.unwrap_model(model).cpu()` while DDP still holds the parameters:
    the in-place conversion (`_C._set_data`, what `param.data = x` does for CUDA) keeps the Parameter objects."""
    code = f"""
        import warnings, torch, torch.distributed as dist
        dist.init_process_group("neuron", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        model = torch.nn.Linear(3, 2).to("neuron")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp(torch.ones(4, 3, device="neuron")).sum().backward()
        expected, weight = model.weight.detach().cpu(), model.weight
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.cpu()
        assert model.weight is weight and weight.device.type == "cpu" and torch.equal(weight.detach(), expected)
        print("OK")
    """
    assert "OK" in run_py(code, _env()).stdout


def test_a_patch_that_no_longer_fits_warns_instead_of_breaking_the_import():
    import types

    from torchneuron import integrations

    moved = types.ModuleType("lightning.pytorch.accelerators")  # a release without AcceleratorRegistry
    moved.Accelerator = object
    with pytest.warns(RuntimeWarning, match="could not teach lightning.pytorch.accelerators about `neuron`"):
        integrations._apply(integrations._PATCHES["lightning.pytorch.accelerators"], moved)
