"""The one configuration object (torchneuron/hardware/config.py): every variable read there, validated there, and
listed in the README; nothing else reads or writes the environment."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from conftest import run_py

from torchneuron.hardware import config

REPO = Path(__file__).resolve().parents[1]

# A valid non-default value per variable torchneuron reads: each must change the loaded configuration.
SAMPLES = {"TORCHNEURON_INSTANCE": "trn1.32xlarge", "NEURON_LOGICAL_NC_CONFIG": "1", "NEURON_RT_VISIBLE_CORES": "1,2",
           "TORCHNEURON_MEMORY_LIMIT": "1GiB", "TORCHNEURON_DTYPE_POLICY": "host", "TORCHNEURON_FALLBACK": "error",
           "LOCAL_RANK": "1", "TORCHNEURON_COMPILE_FALLBACK": "eager", "TORCHNEURON_CACHE_DIR": "/tmp/c",
           "XDG_CACHE_HOME": "/tmp/xdg", "TORCHINDUCTOR_CACHE_DIR": "/tmp/i", "TORCHNEURON_DEBUG_DIR": "/tmp/d",
           "TORCHNEURON_DIST_CHECKS": "0", "TORCHNEURON_CUDA_COMPAT": "1", "TORCHNEURON_PORTING_REPORT": "-",
           "TORCHNEURON_LAUNCH_BLOCKING": "1", "TORCHNEURON_STREAM_CHECK": "1", "TORCHNEURON_EAGER_FUSION": "0",
           "TORCHNEURON_EXIT_TIMEOUT": "5", "TORCHNEURON_FUSION_COMPILE_BUDGET": "30",
           "NEURON_PLATFORM_TARGET_OVERRIDE": "trn1"}
READ_BY_TORCH = {"TORCH_DEVICE_BACKEND_AUTOLOAD"}


def test_readme_table_is_the_config_modules():
    assert config.table() in (REPO / "README.md").read_text(), "README's table differs: paste config.table()"
    assert {v.name for v in config.VARIABLES} == SAMPLES.keys() | READ_BY_TORCH


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_variable_is_read(name):
    env = {"HOME": "/home/u"}
    assert config.load(env) != config.load({**env, name: SAMPLES[name]})


@pytest.mark.parametrize("name,value,valid", [
    ("TORCHNEURON_COMPILE_FALLBACK", "sometimes", "error, eager"),
    ("TORCHNEURON_DIST_CHECKS", "maybe", "1, 0"),
    ("TORCHNEURON_CUDA_COMPAT", "2", "1, 0"),
    ("TORCHNEURON_FALLBACK", "loud", "warn, silent, error"),
])
def test_an_invalid_value_names_the_valid_ones(name, value, valid):
    with pytest.raises(config.ConfigError, match=f"{name}='{value}': choose one of {valid}"):
        config.load({name: value})


def test_at_use_variables_follow_the_environment_and_registration_ones_do_not(monkeypatch):
    before = config.current()
    monkeypatch.setenv("TORCHNEURON_DIST_CHECKS", "0")
    monkeypatch.setenv("TORCH_NEURONX_DEBUG_DIR", "/tmp/aws-debug")  # an alias of an at-use variable
    monkeypatch.setenv("TORCHNEURON_FALLBACK", "error")  # read once, at registration
    now = config.current()
    assert not now.dist_checks and now.debug_dir == Path("/tmp/aws-debug")
    assert now.fallback_policy == before.fallback_policy and now.visible_cores == before.visible_cores
    monkeypatch.setenv("TORCHNEURON_DIST_CHECKS", "maybe")
    with pytest.raises(config.ConfigError, match="TORCHNEURON_DIST_CHECKS='maybe'"):
        config.current()
    monkeypatch.delenv("TORCHNEURON_DIST_CHECKS")
    assert config.current().dist_checks


def test_scoped_env_restores():
    name = "TORCHINDUCTOR_CACHE_DIR"
    old = os.environ.get(name)
    with config.scoped_env(name, "/tmp/x"):
        assert os.environ[name] == "/tmp/x" and config.current().inductor_cache_dir == "/tmp/x"
    assert os.environ.get(name) == old


def test_an_invalid_tool_variable_fails_at_first_device_use_not_at_import():
    p = run_py("""
        import torch
        print(torch.ones(2).sum().item())
        try:
            torch.ones(1).neuron()
        except RuntimeError as e:
            print("TORCHNEURON_DIST_CHECKS='maybe': choose one of 1, 0" in str(e))
    """, {"TORCHNEURON_DIST_CHECKS": "maybe", "TORCHNEURON_CUDA_COMPAT": "1"})
    assert p.stdout.split() == ["2.0", "True"], p.stdout + p.stderr[-800:]


def _environment_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(REPO)}:{n.lineno} os.{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv", "putenv", "unsetenv", "environb")]


def test_nothing_else_reads_or_writes_the_environment():
    files = [p for d in ("torchneuron", "torch_neuronx") for p in (REPO / d).rglob("*.py")]
    uses = [u for p in files if p != REPO / "torchneuron/hardware/config.py" for u in _environment_uses(p)]
    assert not uses, uses
    assert _environment_uses(REPO / "torchneuron/hardware/config.py")  # the check sees attribute reads


def test_aws_async_switch_is_the_inverse_of_launch_blocking():
    assert config.load({"TORCH_NEURONX_ENABLE_ASYNC_NRT": "0"}).launch_blocking
    assert not config.load({"TORCH_NEURONX_ENABLE_ASYNC_NRT": "1"}).launch_blocking
    with pytest.raises(config.ConfigError, match="TORCH_NEURONX_ENABLE_ASYNC_NRT='maybe'"):
        config.load({"TORCH_NEURONX_ENABLE_ASYNC_NRT": "maybe"})
