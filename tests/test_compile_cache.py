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
from helpers import clean_env

from torchneuron.compiler import cache as cache_mod
from torchneuron.compiler import inductor

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
    env = clean_env(("TORCHINDUCTOR_",), **{"TORCHNEURON_CACHE_DIR": str(cache_dir), **(extra_env or {})})
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
    # every kernel of the second process came from the cache (no Inductor build): that is the saving, whatever the
    # machine's load makes of the compile times (benchmarks/bench_compile.py measures them)
    assert not m1["cache_hit"] and m2["cache_hit"] and m2["cached_kernels"] == m2["kernels"] == 2
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

    base = inductor.target()
    cfg = torch.neuron.config()
    other = next(i for i in INSTANCES.values() if i.name != cfg.instance.name)
    monkeypatch.setattr(torch.neuron, "config", lambda: dataclasses.replace(cfg, instance=other))
    assert inductor.target()["instance"] == other.name and inductor.target() != base
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert inductor.target()["threads"] == 97


@pytest.mark.slow
def test_corrupt_compiled_artifacts_are_rebuilt(warm, tmp_path):
    """A truncated compiled kernel used to crash the process (bus error) and random bytes failed every later
    run (ImportError): Inductor's artifacts are verified before they are loaded, and rebuilt. Two damaged
    copies of the warm cache, run at once: (a) the libraries truncated and the generated Python sources
    overwritten with random bytes, (b) the libraries overwritten with random bytes."""
    import hashlib
    import shutil

    damages = {"a": {"so": "truncate", "py": "random"}, "b": {"so": "random"}}
    procs = {}
    for name, damage in damages.items():
        d = tmp_path / name
        shutil.copytree(warm[0], d)
        for ext, how in damage.items():
            files = [f for f in (d / "inductor").rglob(f"*.{ext}") if f.is_file()]
            assert files, sorted(map(str, (d / "inductor").rglob("*")))
            for f in files:
                data = f.read_bytes()
                f.write_bytes(data[:len(data) // 3] if how == "truncate" else os.urandom(len(data)))
        procs[name] = compile_in_subprocess(d)
    for name, p in procs.items():
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, (name, err[-3000:])  # -7 (SIGBUS) or an ImportError before
        run = json.loads(out.strip().splitlines()[-1])
        assert run["loss"] == warm[1]["loss"] and run["metrics"][0]["cache_hit"], (name, run)
        assert "corrupt compile artifact" in err, (name, err[-2000:])
        for so in (tmp_path / name / "inductor").rglob("*.so"):  # rebuilt and recorded: the next run trusts it
            assert (so.parent / f"{so.name}.sha256").read_text() == hashlib.sha256(so.read_bytes()).hexdigest()
            assert so.read_bytes()[:4] == b"\x7fELF"


def _compile_twice(x):
    outs = []
    for k in (2.0, 3.0):
        torch._dynamo.reset()
        outs.append(torch.compile(lambda x, k=k: x * k + 1, backend="neuron")(x))
    return outs


@pytest.mark.parametrize("layout", ["dir is a file", "dir under a file", "kernels is a file", "entry is a dir"])
def test_an_unusable_cache_turns_itself_off_with_one_warning(tmp_path, monkeypatch, layout):
    """Each used to fail every compile (even with TORCHNEURON_COMPILE_FALLBACK=eager). Tests run as root, for
    whom permissions do not block reads: the layouts make the operating system refuse the operations."""
    import warnings

    root = tmp_path / "cache"
    if layout == "dir is a file":
        root.write_text("not a directory")
    elif layout == "dir under a file":
        (tmp_path / "file").write_text("")
        root = tmp_path / "file" / "cache"
    elif layout == "kernels is a file":
        root.mkdir(mode=0o700)
        (root / "kernels").write_text("")
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", str(root))
    x = torch.arange(4.0, device="neuron")
    if layout == "entry is a dir":  # the entry's file name is taken by a directory: unreadable, cannot be removed
        _compile_twice(x)
        for f in entries(root):
            f.unlink()
            f.mkdir()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        outs = _compile_twice(x)
    assert [o.cpu().tolist() for o in outs] == [[1.0, 3.0, 5.0, 7.0], [1.0, 4.0, 7.0, 10.0]]
    cache_warnings = [str(m.message) for m in w if "compile cache" in str(m.message)]
    assert len(cache_warnings) == 1 and "the cache is off" in cache_warnings[0], [str(m.message) for m in w]
