"""PyTorch's OpInfo database on `neuron` against the CPU, samples made on the device (like test_compare_cpu).

Under TORCHNEURON_DTYPE_POLICY=host every float32 forward sample, and the gradients of the first sample that has
any, must match the CPU; an op none of whose samples has a gradient to compare is skipped with the reason. Random
samples (the neuron generator is Philox, the CPU's mt19937) must match the CPU's shapes and dtypes and be
reproducible bit for bit under the same seed; PyTorch's own test_compare_cpu skips them for GPUs.
Not run: ops whose output is uninitialised memory, CUDA-only jiterator entries, and as_strided.partial_views (it
reads storage outside the sample's view, which a CPU copy of the view cannot carry). Sparse-layout entries must
raise a clear NotImplementedError.
"""
import warnings

import pytest
import torch
from opinfo_harness import OPS, compare_backward, compare_forward

import torchneuron

SPARSE = {"sparse.sampled_addmm", "sparse.mm.reduce"}  # produce sparse compressed layouts: NotImplementedError
UNINITIALISED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}
EXCLUDED = UNINITIALISED | {"as_strided.partial_views"} | {n for n in OPS if n.startswith("jiterator")}
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
    if not compare_forward(OPS[name], torch.float32, atol=1e-3, rtol=1e-3):
        pytest.skip("the op has no float32 sample")


@pytest.mark.parametrize("name", BACKWARD)
def test_backward_float32(name):
    if not compare_backward(OPS[name], torch.float32, atol=1e-3, rtol=1e-3):
        pytest.skip("no sample has a gradient to compare: no differentiable output, no input reached, or the CPU "
                    "cannot take the gradient itself")


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_sparse_layouts_raise_cleanly(name):
    with pytest.raises(NotImplementedError, match="neuron|Sparse|sparse"):
        compare_forward(OPS[name], torch.float32, atol=1e-3, rtol=1e-3)


def test_coverage():
    assert len(FLOAT32) > 660 and len(BACKWARD) > 500, (len(FLOAT32), len(BACKWARD))
    assert EXCLUDED <= set(OPS) and len(EXCLUDED) == 12
