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



def test_ops_with_int64_results_stay_queued():
    """Max pooling's indices, argmax of floats and of int64 values: queued behind the stream's work, so a CNN with
    max pooling does not wait for the device every step (the int64 rule looks at values on the worker, and not at
    an op's indices into arguments that cannot hold 2^31 elements)."""
    from torchneuron import _C

    x = torch.randn(8, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    d = x.to("neuron")
    pool = torch.nn.MaxPool2d(2, return_indices=True)
    for _ in range(2):  # the first call of a signature learns its layout on the host
        out, idx = pool(d)
        arg = d.flatten(1).argmax(1)
        ints = torch.arange(40, device="neuron").view(4, 10).argmax(1)
    big = torch.randn(1 << 20, device="neuron")
    big.mul_(2)
    torchneuron.clear_op_tracking()
    big.mul_(2)  # queued work the next launches come after
    out, idx = pool(d)
    arg = d.flatten(1).argmax(1)
    queued, waited = _C._queued_ops(), _C._waiting_ops()
    assert queued.get("aten::max_pool2d_with_indices") == 1 and queued.get("aten::argmax") == 1, queued
    assert not waited, waited
    torch.arange(40, device="neuron")
    big.mul_(2)
    ints = torch.arange(40, device="neuron").view(4, 10).argmax(1)  # int64 values in
    assert _C._queued_ops().get("aten::argmax") == 2 and not _C._waiting_ops()
    ref_out, ref_idx = pool(x)
    assert torch.equal(out.cpu(), ref_out) and torch.equal(idx.cpu(), ref_idx)
    assert torch.equal(arg.cpu(), x.flatten(1).argmax(1)) and ints.tolist() == [9, 9, 9, 9]


def test_int64_writes_are_queued_and_checked_when_they_run():
    """An int64 result or in-place update (BatchNorm's num_batches_tracked) is queued like any kernel; the rule
    looks at the values when the kernel has run, and warns on the user's thread at its next op."""
    from torchneuron import _C

    big = torch.randn(1 << 20, device="neuron")
    counter = torch.zeros((), dtype=torch.int64, device="neuron")
    for _ in range(2):  # the first call of a signature learns its layout on the host
        big.mul_(1.0)
        counter.add_(1)
    torchneuron.clear_op_tracking()
    big.mul_(1.0)  # queued work the next launches come after
    counter.add_(1)
    assert _C._queued_ops().get("aten::add_") == 1 and not _C._waiting_ops()
    assert counter.item() == 3
    near = torch.full((4,), 2**31 - 2, dtype=torch.int64, device="neuron")
    near.add_(1)
    big.mul_(1.0)
    with pytest.warns(UserWarning, match="aten::add_ produced int64 values outside the int32 range"):
        near.add_(5)  # queued: checked when it runs, warned at the next op (reading it back)
        assert near[0].item() == 2**31 + 4
    assert torchneuron.get_dtype_events()["aten::add_"] == 1


def test_int64_copies_to_the_device_are_checked_at_the_call_and_queued():
    """Token ids copied to the device every step: checked on the host at the call, then queued behind the stream's
    work (it no longer waits for it)."""
    w = torch.randn(1024, 1024, device="neuron") / 32
    x = torch.randn(1024, 1024, device="neuron")
    ids = torch.randint(0, 50000, (64, 1024))
    for _ in range(2):
        x = torch.tanh(x @ w)
    torch.neuron.synchronize()
    for _ in range(6):
        x = torch.tanh(x @ w)  # ~0.2 s of queued work
    dev = ids.to("neuron")
    assert not torch.neuron.current_stream().query(), "the copy waited for the stream's work"
    assert torch.equal(dev.cpu(), ids)
    torchneuron.clear_op_tracking()  # re-arms the once-per-op warnings
    with pytest.warns(UserWarning, match="int32 range"):
        torch.tensor([2**35]).expand(64, 1024).to("neuron")

def test_policy_from_environment():
    code = "import torch; print((torch.ones(1, dtype=torch.float64, device='neuron') / 3).item())"
    assert float(run_py(code).stdout) == THIRD_F32
    assert float(run_py(code, {"TORCHNEURON_DTYPE_POLICY": "host"}).stdout) == THIRD


def test_bad_policy_value():
    with pytest.raises(ValueError, match="dtype policy"):
        torchneuron.set_policies("fp16-everything")
