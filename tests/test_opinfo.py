"""PyTorch's OpInfo database on `neuron` against the CPU, samples made on the device (like test_compare_cpu).

Under TORCHNEURON_DTYPE_POLICY=host every float32 forward sample and every first-sample backward gradient must
match the CPU. OpInfo entries PyTorch itself excludes from test_compare_cpu, and CUDA-only jiterator entries, are
not run; sparse-layout samples must raise a clear NotImplementedError. bfloat16 and the default (trainium) policy
are covered by `test_bfloat16_report` and `test_trainium_policy_deviations`.
"""
import warnings

import pytest
import torch
from opinfo_harness import OPS, compare_backward, compare_forward, pytorch_skips_compare_cpu

import torchneuron

SPARSE = {"sparse.sampled_addmm", "sparse.mm.reduce", "to_sparse"}  # produce sparse layouts: NotImplementedError
EXCLUDED = {name for name, op in OPS.items() if name.startswith("jiterator") or pytorch_skips_compare_cpu(op)}
FLOAT32 = sorted(n for n, op in OPS.items()
                 if torch.float32 in op.supported_dtypes("cpu") and n not in EXCLUDED | SPARSE)
BACKWARD = [n for n in FLOAT32 if OPS[n].supports_autograd]


@pytest.fixture(autouse=True)
def host_policy():
    torchneuron.set_policies("host", "silent")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torchneuron.set_policies("trainium", "warn")


@pytest.mark.parametrize("name", FLOAT32)
def test_forward_float32(name):
    compare_forward(OPS[name], torch.float32, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("name", BACKWARD)
def test_backward_float32(name):
    compare_backward(OPS[name], torch.float32, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_sparse_layouts_raise_cleanly(name):
    with pytest.raises(NotImplementedError, match="neuron|Sparse|sparse"):
        compare_forward(OPS[name], torch.float32, atol=1e-3, rtol=1e-3)


def test_coverage():
    assert len(FLOAT32) > 600 and len(BACKWARD) > 450
    assert len(EXCLUDED) < 40, sorted(EXCLUDED)
