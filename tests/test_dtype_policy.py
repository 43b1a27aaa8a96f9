"""Trainium dtype rules: float64 carries float32 precision, int64 outside int32 warns; `host` is exact."""
import pytest
import torch
from conftest import run_py

import torchneuron

THIRD = 1 / 3
THIRD_F32 = float(torch.tensor(THIRD, dtype=torch.float32))


def test_float64_carries_float32_precision():
    x = torch.tensor([THIRD], dtype=torch.float64)
    with pytest.warns(UserWarning, match="float32 precision"):
        d = x.neuron()
    assert d.dtype == torch.float64 and d.item() == THIRD_F32
    with pytest.warns(UserWarning, match="aten::div produced float64"):
        y = torch.ones(1, dtype=torch.float64, device="neuron") / 3
    assert y.dtype == torch.float64 and y.item() == THIRD_F32
    assert torchneuron.get_dtype_events()["aten::div"] == 1


def test_warns_once_per_op_and_counts_every_event():
    a = torch.ones(4, dtype=torch.float64, device="neuron")
    with pytest.warns(UserWarning, match="aten::mul"):
        a * 3
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a * 3
        a * 5
    assert torchneuron.get_dtype_events()["aten::mul"] == 3


def test_float32_is_untouched(no_warnings):
    a = torch.randn(100, device="neuron")
    assert torch.equal((a / 3).cpu(), a.cpu() / 3)
    assert torchneuron.get_dtype_events() == {}


def test_data_movement_keeps_bits(no_warnings):
    torchneuron.set_policies("host")
    a = torch.tensor([THIRD, 2 * THIRD], dtype=torch.float64, device="neuron")
    torchneuron.set_policies("trainium")
    b = torch.cat([a, a]).flip(0).clone()  # pure data movement: exact even under the trainium policy
    assert b[0].item() == 2 * THIRD


def test_host_policy_is_full_precision(no_warnings):
    torchneuron.set_policies("host")
    y = torch.ones(1, dtype=torch.float64, device="neuron") / 3
    assert y.item() == THIRD
    assert (torch.full((2,), 2**40, dtype=torch.int64, device="neuron") + 1)[0].item() == 2**40 + 1


def test_int64_outside_int32_warns_but_is_kept():
    with pytest.warns(UserWarning, match="outside the int32 range"):
        t = torch.full((3,), 2**40, dtype=torch.int64, device="neuron")
    assert t[0].item() == 2**40
    with pytest.warns(UserWarning, match="int32 range"):
        torch.tensor([2**35]).neuron()


def test_int64_in_range_is_silent(no_warnings):
    idx = torch.arange(1000, device="neuron")
    assert idx.sum().item() == 499500


def test_policy_from_environment():
    code = "import torch; print((torch.ones(1, dtype=torch.float64, device='neuron') / 3).item())"
    assert float(run_py(code).stdout) == THIRD_F32
    assert float(run_py(code, {"TORCHNEURON_DTYPE_POLICY": "host"}).stdout) == THIRD


def test_bad_policy_value():
    with pytest.raises(ValueError, match="dtype policy"):
        torchneuron.set_policies("fp16-everything")
