"""CUDA training scripts modelled on public ones (tests/fixtures/cuda_scripts): the original under compat mode,
then the same script after `torchneuron fix --write` on neuron without compat and with plain PyTorch on CPU,
must give the same results; `check` on the fixed scripts leaves only findings that need a person."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_migrate_compat import SCRIPTS, _env, run_all

import torchneuron
from torchneuron.migrate import check

ROOT = str(Path(torchneuron.__file__).parents[1])  # this checkout, also for the compat-mode subprocesses

NAMES = ["amp_timing", "ddp_fstring", "hf_style", "nanogpt_style", "nvtx_ranges", "pinned_batches", "resume_rng",
         "stream_events", "streams_memory", "timm_style", "torchtitan_style", "vendor_ladder"]
# TF32 changes numerics: a decision. (`"cuda" in device` is rewritten with `device`'s own rewrite.)
LEFT = [("nanogpt_style", "NRN032", "suggest"), ("nanogpt_style", "NRN032", "suggest")]
ONLY_ON = {"ddp_fstring": "backend", "torchtitan_style": "mesh", "vendor_ladder": "accelerators",  # device facts
           "stream_events": "timed"}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[str, dict]]:
    d = tmp_path_factory.mktemp("scripts")
    (d / "sitecustomize.py").write_text("import torchneuron.integrations.cuda_compat as c\nc.maybe_enable_from_env()\n")
    fixed = d / "fixed"
    fixed.mkdir()
    for f in SCRIPTS.glob("*.py"):
        shutil.copy(f, fixed / f.name)
    p = subprocess.run([sys.executable, "-m", "torchneuron.cli", "fix", "--write", str(fixed)], capture_output=True,
                       text=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr
    compat_env = _env(TORCHNEURON_CUDA_COMPAT="1", PYTHONPATH=os.pathsep.join([str(d), ROOT]))
    return {"compat": run_all(compat_env, d, SCRIPTS, NAMES), "neuron": run_all(_env(), d, fixed, NAMES),
            "cpu": run_all(_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"), d, fixed, NAMES), "dir": fixed}


@pytest.mark.parametrize("name", NAMES)
def test_fixed_script_matches_the_original_under_compat(results, name):
    compat, neuron, cpu = (results[k][name] for k in ("compat", "neuron", "cpu"))
    assert "error" not in compat and compat["device"] == "neuron:0", compat
    for target, out in (("neuron", neuron), ("cpu", cpu)):
        assert "error" not in out and out["device"].startswith(target), (target, out)
        assert out["losses"] == pytest.approx(compat["losses"], rel=1e-5, abs=1e-5), target
        extra = {k: v for k, v in out.items() if k not in ("losses", "device", ONLY_ON.get(name))}
        assert extra == {k: compat[k] for k in extra}, (target, out, compat)
    assert neuron == compat  # on neuron, everything the script reports is what compat mode gave


def test_fixed_scripts_leave_only_decisions(results):
    """After `fix --write`, `check` reports no auto finding, and each remaining one says what to decide."""
    rep = check.check_paths([str(results["dir"] / f"{n}.py") for n in NAMES])
    assert [f for f in rep.findings if f.fix == "auto"] == []
    left = sorted((Path(f.path).stem, f.code, f.fix) for f in rep.findings)
    assert left == LEFT
    assert all(";" in f.message for f in rep.findings)
