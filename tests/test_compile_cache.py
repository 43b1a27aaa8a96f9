"""The on-disk compile cache: reuse by a second process, concurrent writers, corrupt entries, safety, keys."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo

from torchneuron.compiler import cache as cache_mod
from torchneuron.compiler import kernel

# A training step compiled in a fresh process; prints its compile metrics as JSON.
PROGRAM = textwrap.dedent("""
    import json, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to("neuron")
    step = torch.compile(lambda x: model(x).square().mean(), backend="neuron")
    loss = step(torch.randn(16, 32, device="neuron"))
    loss.backward()
    print(json.dumps({"loss": loss.item(), "metrics": torch.neuron.get_dynamo_metrics()}))
""")


def compile_in_subprocess(cache_dir, extra_env: dict | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHNEURON_", "TORCHINDUCTOR_"))}
    env.update({"TORCHNEURON_CACHE_DIR": str(cache_dir), **(extra_env or {})})
    return subprocess.Popen([sys.executable, "-c", PROGRAM], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def entries(cache_dir) -> list:
    return sorted((cache_dir / "kernels").rglob("*.json"))


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A cache filled by one process, then used by a second: (cache dir, first run, second run)."""
    d = tmp_path_factory.mktemp("cache")
    first = result(compile_in_subprocess(d))
    second = result(compile_in_subprocess(d))
    return d, first, second


def test_second_process_reuses_the_cache(warm):
    d, first, second = warm
    (m1,), (m2,) = first["metrics"], second["metrics"]
    assert not m1["cache_hit"] and m2["cache_hit"] and m2["cached_kernels"] == m2["kernels"] == 2
    assert m2["compile_time_s"] < 0.7 * m1["compile_time_s"], (m1["compile_time_s"], m2["compile_time_s"])
    assert first["loss"] == second["loss"]


def test_entries_are_checksummed_text(warm):
    d = warm[0]
    files = entries(d)
    assert len(files) == 2
    for f in files:
        e = json.loads(f.read_text())
        assert e["key"] == f.stem and "def call(" in e["source"]
        assert e["sha256"] == cache_mod.digest({k: v for k, v in e.items() if k != "sha256"})
    assert not list((d / "kernels").rglob("*.tmp"))
    assert oct(d.stat().st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("damage", ["truncate", "tamper"])
def test_corrupt_entry_is_detected_and_rebuilt(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", str(tmp_path))
    f = torch.compile(lambda x: x.cos() * 3, backend="neuron")
    x = torch.randn(8, device="neuron")
    torch._dynamo.reset()
    f(x)
    (entry,) = entries(tmp_path)
    text = entry.read_text()
    damaged = text[:len(text) // 2] if damage == "truncate" else text.replace("def call(", "def cal1(")
    entry.write_text(damaged)
    torch._dynamo.reset()
    torch.neuron.reset_dynamo_metrics()
    with pytest.warns(UserWarning, match="corrupt compile-cache entry"):
        out = f(x)
    torch.testing.assert_close(out, x.cos() * 3)
    assert not torch.neuron.get_dynamo_metrics()[0]["cache_hit"]
    rebuilt = json.loads(entry.read_text())
    assert rebuilt["sha256"] == cache_mod.digest({k: v for k, v in rebuilt.items() if k != "sha256"})


def test_concurrent_processes_share_a_cold_cache(tmp_path):
    procs = [compile_in_subprocess(tmp_path) for _ in range(2)]
    runs = [result(p) for p in procs]
    assert runs[0]["loss"] == runs[1]["loss"]
    for f in entries(tmp_path):
        e = json.loads(f.read_text())
        assert e["sha256"] == cache_mod.digest({k: v for k, v in e.items() if k != "sha256"})
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_directory_others_can_write_is_not_used(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", str(shared))
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="not private"):
        out = torch.compile(lambda x: x + 2, backend="neuron")(torch.ones(2, device="neuron"))
    assert torch.equal(out.cpu(), torch.full((2,), 3.0))
    assert not (shared / "kernels").exists()


def test_key_covers_the_modelled_target(monkeypatch):
    import dataclasses

    from torchneuron.hardware.chips import INSTANCES

    base = kernel._target()
    cfg = torch.neuron.config()
    other = next(i for i in INSTANCES.values() if i.name != cfg.instance.name)
    monkeypatch.setattr(torch.neuron, "config", lambda: dataclasses.replace(cfg, instance=other))
    assert kernel._target()["instance"] == other.name and kernel._target() != base
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert kernel._target()["threads"] == 97
