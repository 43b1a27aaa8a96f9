"""Shared test helpers. `import torch` autoloads the neuron device (the entry point under test)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import torchneuron


def run_py(code: str, env: dict | None = None, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Run Python code in a fresh interpreter (for environment-dependent behaviour); returns the process."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHNEURON_", "NEURON_"))}
    full_env.update(env or {})
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=full_env, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"subprocess failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture(autouse=True)
def _device_state():
    """Each test starts on neuron:0 with the default policies and clean op counters."""
    torchneuron.set_policies("trainium", "warn")
    torchneuron.clear_op_tracking()
    torch.neuron.set_device(0)
    yield
    torchneuron.set_policies("trainium", "warn")
    torch.neuron.set_device(0)


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield
