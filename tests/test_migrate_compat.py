"""CUDA compatibility mode: unmodified CUDA scripts (tests/fixtures/cuda_scripts) run on neuron with the losses
of a plain-torch CPU run, and the redirect machinery (isinstance, compile, pre-imported names) holds.
Compat mode patches the process for good, so everything runs in subprocesses."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_py
from helpers import clean_env

SCRIPTS = Path(__file__).parent / "fixtures" / "cuda_scripts"
sys.path.insert(0, str(SCRIPTS))
import common  # noqa: E402

REFERENCES = {  # script -> CPU reference losses (plain torch, same seeds and model code), tolerance
    "amp_train": (lambda: common.reference(amp=True), 2e-3),
    "bench": (lambda: common.reference(), 1e-5),
    "checkpoint": (lambda: common.reference(momentum=0.9), 1e-5),
    "dataloader": (lambda: common.reference(batch=4), 1e-5),
}


_env = functools.partial(clean_env, PYTHONWARNINGS="ignore")  # a child's environment: no device configuration


@pytest.fixture(scope="module")
def autoload_shim(tmp_path_factory) -> str:
    """A sitecustomize calling the autoload hook, until torchneuron/__init__.py calls it (.notes/requests.md)."""
    d = tmp_path_factory.mktemp("shim")
    (d / "sitecustomize.py").write_text("import torchneuron.integrations.cuda_compat as c\nc.maybe_enable_from_env()\n")
    return str(d)


def last_json(stdout: str) -> dict:
    """The last line's result record. Under torchrun the ranks share stdout, so another rank's output can follow
    the record on its line: only the JSON object itself is read."""
    line = next(line for line in reversed(stdout.splitlines()) if line.startswith('{"losses"'))
    return json.JSONDecoder().raw_decode(line)[0]


def run_script(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=240)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout}\n{p.stderr[-4000:]}"
    return p


def check_losses(name: str, out: dict) -> None:
    ref, tol = REFERENCES[name]
    assert out["device"].startswith("neuron"), out
    assert out["losses"] == pytest.approx(ref(), rel=tol, abs=tol)


DRIVER = """
import contextlib, io, json, os, runpy, sys
tmp, names = sys.argv[1], sys.argv[2:]
sys.path.insert(0, os.path.dirname(names[0]))
for name in names:  # one interpreter for all scripts: each import of torch costs seconds on the test machines
    sys.argv, out = [name, tmp], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(name, run_name="__main__")
        print(out.getvalue().splitlines()[-1])
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
"""


def run_all(env: dict[str, str], cwd: Path, scripts: Path = SCRIPTS, names: list[str] | None = None
            ) -> dict[str, dict]:
    """{script name: its last JSON line} for every single-process script (or `names`), run in one interpreter."""
    names = names or sorted(REFERENCES)
    p = run_script([sys.executable, "-c", DRIVER, str(cwd), *(str(scripts / f"{n}.py") for n in names)], env, cwd)
    return dict(zip(names, map(json.loads, p.stdout.splitlines()[-len(names):]), strict=True))


@pytest.fixture(scope="module")
def env_compat(autoload_shim, tmp_path_factory) -> tuple[dict[str, dict], dict]:
    """The scripts under TORCHNEURON_CUDA_COMPAT=1, and the porting report written at exit."""
    d = tmp_path_factory.mktemp("compat")
    env = _env(TORCHNEURON_CUDA_COMPAT="1", PYTHONPATH=autoload_shim, TORCHNEURON_PORTING_REPORT=str(d / "r.json"))
    return run_all(env, d), json.loads((d / "r.json").read_text())


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_script_runs_unmodified_under_env_compat(name, env_compat):
    outs, report = env_compat
    out = outs[name]
    check_losses(name, out)
    assert report["compat_enabled"] and sum(report["executed_ops"].values()) > 0
    assert any(f"{name}.py:" in site for sites in report["redirects"].values() for site in sites)
    if name == "amp_train":  # AMP really ran, in CUDA's fp16, and the scaler was live
        assert out["amp_dtype"] == "torch.float16" and out["scale"] == 65536.0 and out["allocated"] > 0


def test_script_runs_unmodified_under_torchneuron_run(tmp_path):
    p = run_script([sys.executable, "-m", "torchneuron.cli", "run", str(SCRIPTS / "amp_train.py")], _env(), tmp_path)
    check_losses("amp_train", last_json(p.stdout))
    assert "torchneuron porting report" in p.stdout and "amp_train.py:" in p.stdout


def test_ddp_under_torchrun_with_nccl(tmp_path):
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           "-m", "torchneuron.cli", "run", str(SCRIPTS / "ddp_train.py")]
    out = last_json(run_script(cmd, _env(OMP_NUM_THREADS="1"), tmp_path).stdout)
    assert out["backend"] == "neuron" and out["device"] == "neuron:0"
    assert out["losses"] == pytest.approx(common.reference(batch=8, n=8 * common.STEPS), rel=1e-5, abs=1e-5)


def test_env_compat_under_torchrun_writes_one_report_per_rank(tmp_path):
    """compat.md's `TORCHNEURON_PORTING_REPORT=port.json torchrun ...`: every process writes at exit, torchrun's
    launcher too (it imports torch), which exited last and left an empty report. Each rank now writes its own, with
    its redirects; the launcher writes none."""
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           str(SCRIPTS / "ddp_train.py")]
    env = _env(OMP_NUM_THREADS="1", TORCHNEURON_CUDA_COMPAT="1", TORCHNEURON_PORTING_REPORT=str(tmp_path / "port.json"))
    out = last_json(run_script(cmd, env, tmp_path).stdout)
    assert out["backend"] == "neuron"
    assert not (tmp_path / "port.json").exists()
    for rank in (0, 1):
        report = json.loads((tmp_path / f"port.rank{rank}.json").read_text())
        assert any("ddp_train.py:" in site for sites in report["redirects"].values() for site in sites), report


def test_redirect_depth_isinstance_and_compile():
    run_py("""
        import io, torch
        from torch.cuda.amp import GradScaler  # imported before enable(): still covered
        from torch.cuda import Event as EarlyEvent
        from torchneuron.integrations import cuda_compat as compat
        compat.enable(); compat.enable()  # idempotent
        s, e, early = torch.cuda.Stream(), torch.cuda.Event(enable_timing=True), EarlyEvent()
        assert isinstance(s, torch.cuda.Stream) and isinstance(e, torch.cuda.Event) and isinstance(early, EarlyEvent)
        assert s.device.type == "neuron" and torch.cuda.current_stream().device.type == "neuron"
        g = torch.Generator(device="cuda")
        assert g.device.type == "neuron" and isinstance(torch.default_generator, torch.Generator)
        assert GradScaler()._device == "neuron" and torch.amp.GradScaler()._enabled
        with torch.autocast("cuda"):
            assert torch.get_autocast_dtype("neuron") == torch.float16 and torch.is_autocast_enabled("neuron")
        with torch.amp.autocast("cuda", dtype=torch.bfloat16):
            assert (torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")).dtype == torch.bfloat16
        x = torch.zeros(3, device=torch.device("cuda", 1))
        assert x.device == torch.device("neuron", 1) and x.is_cuda and torch.ones(1).cuda(1).device.index == 1
        assert torch.cuda.is_available() and torch.cuda.device_count() == torch.neuron.device_count()
        assert torch.distributed.Backend("nccl") == "neuron" and torch.distributed.Backend("gloo") == "gloo"
        buf = io.BytesIO(); torch.save({"w": torch.ones(2)}, buf)
        for loc in ("cuda", "cuda:0", torch.device("cuda"), {"cpu": "cuda:0"}, lambda s, loc: s.cuda()):
            buf.seek(0); assert torch.load(buf, map_location=loc)["w"].device.type == "neuron", loc
        m = torch.nn.Linear(2, 2).to("cuda")
        assert m.weight.device.type == "neuron" and torch.nn.Linear(2, 2).cuda().weight.is_neuron

        @torch.compile(backend="neuron", mode="reduce-overhead")
        def f(a):
            return (a * 2 + torch.ones(3, device="cuda")).sum()
        assert f(torch.ones(3, device="cuda")).item() == 9.0
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            torch.ones(2, device="cuda").sum()
        torch.cuda.manual_seed(3); state = torch.cuda.get_rng_state()
        assert torch.equal(state, torch.neuron.get_rng_state())
        loader = torch.utils.data.DataLoader([torch.ones(2)], pin_memory=True, pin_memory_device="cuda")
        assert next(iter(loader)).is_pinned()
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
        assert dist.get_backend() == "neuron" and init_device_mesh("cuda", (1,)).device_type == "neuron"
        DDP = torch.nn.parallel.DistributedDataParallel
        ddp = DDP(torch.nn.Linear(2, 2).cuda(), device_ids=[torch.device("cuda", 0)])
        ddp(torch.ones(1, 2, device="cuda")).sum().backward()
        dist.destroy_process_group()
        r = compat.redirects()
        for api in ("torch.cuda.Stream", "torch.cuda.Event", "torch.Generator(device=cuda)",
                    "torch.cuda.amp.GradScaler", "torch.amp.GradScaler(cuda)", "torch.amp.autocast(cuda)",
                    "torch.load(cuda location)", "Storage.cuda", "Module.to(cuda)", "Module.cuda", "Tensor.is_cuda",
                    "torch.compile(mode='reduce-overhead')", "torch.profiler.ProfilerActivity.CUDA",
                    "torch.distributed backend 'nccl'", "torch.zeros(device=cuda)", "torch.cuda.get_rng_state",
                    "DataLoader(pin_memory_device=cuda)", "init_device_mesh(cuda)",
                    "DistributedDataParallel(device_ids=cuda)"):
            assert api in r, (api, sorted(r))
        assert all(site.startswith("<string>:") for site in r["torch.cuda.amp.GradScaler"]), r
    """, env={"PYTHONWARNINGS": "ignore"})


def test_module_to_cuda_keeps_parameters():
    """module.to("cuda") converts in place, as module.to("neuron") does: the Parameter objects (and so weight ties
    and an optimizer built before the move) are kept, and the call is counted once."""
    run_py("""
        import torch
        from torchneuron.integrations import cuda_compat as compat
        compat.enable()
        m = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False))
        m[1].weight = m[0].weight
        w, opt = m[0].weight, torch.optim.SGD(m.parameters(), lr=0.1)
        for dev in ("cuda", torch.device("cuda", 0)):
            assert m.to(dev) is m and m[0].weight is w is m[1].weight and w.device == torch.device("neuron", 0)
        m(torch.tensor([1, 2], device="cuda")).sum().backward()
        opt.step()
        assert opt.param_groups[0]["params"][0] is w and w.grad.device.type == "neuron"
        assert sum(compat.redirects()["Module.to(cuda)"].values()) == 2, compat.redirects()
    """, env={"PYTHONWARNINGS": "ignore"})


def test_cuda_idioms_the_first_probe_battery_broke():
    """CUDA idioms that crashed or silently diverged under compat mode (a battery of unmodified snippets): each
    now behaves as on CUDA, checked against the neuron call it stands for or CUDA's documented answer."""
    run_py("""
        import torch
        from torchneuron.integrations import cuda_compat as compat
        compat.enable()
        with torch.cuda.device(torch.device("cuda", 1)):  # was "expected a neuron device, got cuda:1"
            assert torch.cuda.current_device() == 1 and torch.zeros(1, device="cuda").device.index == 1
        assert torch.cuda.current_device() == 0
        # streams and events torch.neuron hands back are torch.cuda.Stream/Event too
        assert isinstance(torch.cuda.default_stream(0), torch.cuda.Stream)
        assert isinstance(torch.cuda.current_stream().record_event(), torch.cuda.Event)
        assert not isinstance(torch.neuron.Event(), torch.cuda.Stream)
        # autocast entered with "cuda" is what the script's queries see (HF modelling code branches on them)
        a = torch.ones(2, 2, device="cuda")
        assert not torch.is_autocast_enabled()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled() and torch.is_autocast_enabled("cuda")
            assert torch.get_autocast_dtype("cuda") == torch.bfloat16 == torch.get_autocast_gpu_dtype()
            assert not torch.is_autocast_enabled("cpu")

        class Fp32MM(torch.autograd.Function):  # custom_fwd(cast_inputs=...) must cast and run autocast-free
            @staticmethod
            @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
            def forward(ctx, x):
                assert not torch.is_autocast_enabled("neuron")
                return x @ x

            @staticmethod
            @torch.amp.custom_bwd(device_type="cuda")
            def backward(ctx, g):
                return g

        with torch.autocast("cuda"):
            assert (a @ a).dtype == torch.float16 and Fp32MM.apply(a.half()).dtype == torch.float32
        # memory fraction (was "Torch not compiled with CUDA enabled"): the neuron allocator's cap
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(0.01)
        assert torch.cuda.get_per_process_memory_fraction() == torch.neuron.get_per_process_memory_fraction() == 0.01
        try:
            torch.empty(total // 50, dtype=torch.uint8, device="cuda")
            raise AssertionError("no OutOfMemoryError past the fraction")
        except torch.cuda.OutOfMemoryError:
            pass
        torch.cuda.set_per_process_memory_fraction(1.0)
        assert torch.cuda.is_current_stream_capturing() is False and torch.cuda.ipc_collect() is None
        torch.set_default_device("cuda")
        assert torch.empty(1).device == torch.device("neuron", 0)
        torch.set_default_device(None)
        # the legacy types (`Tensor = torch.cuda.FloatTensor`): what the CPU type builds, on neuron
        z = torch.cuda.FloatTensor(2, 3).zero_()
        assert z.device.type == "neuron" and z.shape == (2, 3) and isinstance(z, torch.cuda.FloatTensor)
        assert torch.equal(torch.cuda.LongTensor([1, 2]).cpu(), torch.LongTensor([1, 2]))
        assert not isinstance(z, torch.cuda.HalfTensor) and not isinstance(z.cpu(), torch.cuda.FloatTensor)
        h = torch.ones(2).type(torch.cuda.HalfTensor)
        assert h.device.type == "neuron" and h.dtype == torch.float16 and z.type("torch.cuda.DoubleTensor").is_cuda
        torch.set_default_tensor_type(torch.cuda.HalfTensor)  # LLaMA's reference code
        assert torch.empty(1).device.type == "neuron" and torch.empty(1).dtype == torch.float16
        torch.set_default_tensor_type(torch.FloatTensor)
        assert torch.empty(1).device.type == "cpu" and torch.empty(1).dtype == torch.float32
        torch.cuda.random.manual_seed(4)  # the submodules' names too
        assert torch.cuda.random.get_rng_state().equal(torch.neuron.get_rng_state())
        assert torch.cuda.memory.memory_allocated() == torch.neuron.memory_allocated() > 0
        torch.cuda.memory._record_memory_history(max_entries=100)
        kept = torch.ones(256, device="cuda")
        assert any(b["size"] >= 1024 for seg in torch.cuda.memory._snapshot()["segments"] for b in seg["blocks"])
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.set_sync_debug_mode("warn")
        assert torch.cuda.get_sync_debug_mode() == 0  # neuron has no CUDA syncs to warn about
        for make in (torch.cuda.CUDAGraph, lambda: torch.cuda.make_graphed_callables(torch.nn.Linear(1, 1), (a,))):
            try:
                make()
                raise AssertionError("CUDA graphs must raise")
            except RuntimeError as e:
                assert "CUDA graphs" in str(e) and "neuron" in str(e), e
        import torch.distributed as dist  # gloo carries CUDA tensors on CUDA: here neuron's go to the neuron backend
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1).cuda())
        ddp(torch.ones(3, 2, device="cuda")).sum().backward()
        t = torch.arange(3.0, device="cuda")
        dist.all_reduce(t)
        assert dist.get_backend() == "gloo" and torch.equal(t.cpu(), torch.arange(3.0))
        dist.destroy_process_group()
        p = torch.cuda.get_device_properties(0)
        assert (p.major, p.minor) == torch.cuda.get_device_capability(0) == torch.neuron.get_device_capability(0)
        r = compat.redirects()
        for api in ("torch.cuda.device", "torch.is_autocast_enabled()", "torch.is_autocast_enabled(cuda)",
                    "torch.get_autocast_gpu_dtype", "torch.amp.custom_fwd(device_type=cuda)",
                    "torch.cuda.set_per_process_memory_fraction", "torch.set_default_device(cuda)",
                    "torch.distributed backend 'gloo' (cuda tensors)", "torch.cuda.FloatTensor",
                    "Tensor.type(torch.cuda.*Tensor)", "torch.set_default_tensor_type(cuda)",
                    "torch.cuda.manual_seed", "torch.cuda.memory._record_memory_history",
                    "torch.cuda.CUDAGraph"):
            assert api in r, (api, sorted(r))
    """, env={"PYTHONWARNINGS": "ignore"})


def test_processes_a_run_script_spawns_run_in_the_mode(tmp_path):
    """`torchneuron run` puts the mode in the environment, so mp.spawn workers (fresh interpreters) see
    torch.cuda redirected too; before, `torch.cuda.set_device(rank)` in a worker failed (no CUDA build)."""
    script = tmp_path / "spawn.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.multiprocessing as mp

        def worker(rank, q):
            torch.cuda.set_device(rank)
            q.put((rank, torch.ones(2, device="cuda").device.index, torch.cuda.current_device()))

        if __name__ == "__main__":
            q = mp.get_context("spawn").SimpleQueue()
            mp.spawn(worker, args=(q,), nprocs=2)
            print(sorted(q.get() for _ in range(2)))
    """))
    p = run_script([sys.executable, "-m", "torchneuron.cli", "run", str(script)], _env(), tmp_path)
    assert "[(0, 0, 0), (1, 1, 1)]" in p.stdout, p.stdout + p.stderr


@pytest.fixture(scope="module")
def fixed_scripts(tmp_path_factory) -> Path:
    """The fixture scripts after `torchneuron fix --write`."""
    d = tmp_path_factory.mktemp("fixed")
    for f in SCRIPTS.glob("*.py"):
        (d / f.name).write_text(f.read_text())
    run_script([sys.executable, "-m", "torchneuron.cli", "fix", "--write", str(d)], _env(), d)
    return d


@pytest.mark.parametrize("target", ["neuron", "cpu"])
def test_fixed_scripts_run_without_compat(fixed_scripts, target, tmp_path):
    """After `fix`, the scripts run on neuron with no compat mode, and on CPU with plain torch (no autoload)."""
    env = _env(**({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"} if target == "cpu" else {}))
    for name, out in run_all(env, tmp_path, fixed_scripts).items():
        assert out.get("device", "").startswith(target), (name, out)
        if name == "amp_train":  # the fixed script autocasts in the device's default dtype (neuron: fp16, CPU: bf16)
            dtype = getattr(torch, out["amp_dtype"].removeprefix("torch."))
            ref, tol = common.reference(amp=True, amp_dtype=dtype), 2e-2
        else:
            ref, tol = REFERENCES[name][0](), REFERENCES[name][1]
        assert out["losses"] == pytest.approx(ref, rel=tol, abs=tol), name


def test_fixed_ddp_runs_on_neuron_without_compat(fixed_scripts, tmp_path):
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           str(fixed_scripts / "ddp_train.py")]
    out = last_json(run_script(cmd, _env(OMP_NUM_THREADS="1"), fixed_scripts).stdout)
    assert out["backend"] == "neuron" and out["device"] == "neuron:0"
    assert out["losses"] == pytest.approx(common.reference(batch=8, n=8 * common.STEPS), rel=1e-5, abs=1e-5)


def test_compile_under_bf16_autocast_and_nvtx_ranges():
    """A CUDA script that compiles its model (default Inductor backend) and trains under bf16 autocast compiles
    under compat mode as it does without: PyTorch's own `torch.cuda` queries about the host are not redirected
    (they ended in "'NeuronDeviceProperties' object has no attribute 'gcnArchName'"). NVTX ranges become profiler
    ranges, counted in the report."""
    run_py("""
        import torch, torch.nn as nn
        from torchneuron.integrations import cuda_compat as compat
        compat.enable()
        torch.manual_seed(0)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(device)
        ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        ref.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        cmodel = torch.compile(model)
        x = torch.randn(8, 16, device=device)
        with torch.profiler.profile() as prof:
            torch.cuda.nvtx.range_push("step")
            with torch.cuda.nvtx.range("forward"), torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                out = cmodel(x)
            torch.cuda.nvtx.range_pop()
        assert out.device.type == "neuron" and out.dtype == torch.bfloat16, out
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = ref(x.cpu())
        torch.testing.assert_close(out.float().cpu(), want.float(), atol=2e-2, rtol=2e-2)
        assert {"step", "forward"} <= {e.name for e in prof.events()}
        r = compat.redirects()
        assert {"torch.cuda.nvtx.range_push", "torch.cuda.nvtx.range_pop", "torch.cuda.nvtx.range"} <= set(r), r
    """, env={"PYTHONWARNINGS": "ignore"}, timeout=600)
