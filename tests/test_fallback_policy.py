"""Op tracking and the host-fallback policy; the fallback's in-place, out= and view semantics."""
import warnings

import pytest
import torch
from conftest import run_py

import torchneuron


def test_native_ops_are_counted():
    a = torch.randn(8, 8, device="neuron")
    torchneuron.clear_op_tracking()
    (a @ a).relu().sum()
    ops = torchneuron.get_executed_ops()
    assert ops["aten::mm"] == 1 and ops["aten::relu"] == 1 and ops["aten::sum"] == 1
    assert torchneuron.get_fallback_ops() == {}


def test_fallback_ops_warn_once_and_are_counted():
    a = torch.randn(6, 6, device="neuron")
    with pytest.warns(UserWarning, match="aten::linalg_qr is not a native neuron op"):
        torch.linalg.qr(a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.linalg.qr(a)
    assert torchneuron.get_fallback_ops()["aten::linalg_qr"] == 2
    torchneuron.clear_op_tracking()
    assert torchneuron.get_fallback_ops() == {}


def test_fallback_error_policy_names_the_op():
    torchneuron.set_policies(fallback_policy="error")
    a = torch.randn(4, 4, device="neuron")
    with pytest.raises(NotImplementedError, match="aten::linalg_qr is not a native neuron op"):
        torch.linalg.qr(a)
    assert (a @ a).is_neuron  # native ops still run
    p = run_py("import torch; torch.linalg.qr(torch.randn(3, 3, device='neuron'))",
               {"TORCHNEURON_FALLBACK": "error"}, check=False)
    assert p.returncode != 0 and "TORCHNEURON_FALLBACK=error" in p.stderr


def test_silent_policy(no_warnings):
    torchneuron.set_policies(fallback_policy="silent")
    torch.linalg.qr(torch.randn(3, 3, device="neuron"))
    assert torchneuron.get_fallback_ops()["aten::linalg_qr"] == 1


def test_in_place_out_and_views_share_device_memory():
    a = torch.zeros(4, 4, device="neuron")
    v = a[1]  # a view
    v.add_(3)  # in-place through the fallback, on the view
    assert a.sum().item() == 12
    out = torch.empty(4, 4, device="neuron")
    r = torch.mul(a, 2, out=out)
    assert r.data_ptr() == out.data_ptr() and out.sum().item() == 24
    d = a.diagonal()
    d.fill_(1)
    assert a.trace().item() == 4
    u = a.unfold(0, 2, 1)
    assert u.data_ptr() == a.data_ptr() and u.is_neuron


def test_out_argument_resized_by_the_kernel():
    out = torch.empty(0, device="neuron")
    torch.add(torch.ones(3, device="neuron"), 1, out=out)
    assert out.shape == (3,) and out.sum().item() == 6
    base = torch.neuron.memory_allocated()
    out2 = torch.empty(2, device="neuron")
    torch.cat([torch.ones(500, device="neuron")] * 4, out=out2)
    assert out2.shape == (2000,) and out2.sum().item() == 2000
    assert torch.neuron.memory_allocated() - base >= 2000 * 4
    m = torch.empty(5, device="neuron")
    torch.ops.aten.mse_loss.out(torch.ones(3, device="neuron"), torch.zeros(3, device="neuron"), 1, out=m)
    assert m.shape == () and m.item() == 1.0


def test_multiple_outputs_and_complex():
    x = torch.randn(5, 7, device="neuron")
    vals, idx = x.sort(dim=1)
    ref_v, ref_i = x.cpu().sort(dim=1)
    assert torch.equal(vals.cpu(), ref_v) and torch.equal(idx.cpu(), ref_i)
    c = torch.randn(8, dtype=torch.complex64, device="neuron")
    f = torch.fft.fft(c)
    assert torch.allclose(f.cpu(), torch.fft.fft(c.cpu()), atol=1e-5)
    assert torch.equal(c.conj().cpu(), c.cpu().conj())
    assert torch.equal(torch.view_as_real(c).cpu(), torch.view_as_real(c.cpu()))


def test_sparse_compressed_is_a_clear_not_implemented():
    """Sparse COO tensors are supported (tests/test_sparse.py); compressed layouts are refused at the move."""
    with pytest.raises(NotImplementedError, match="neuron: .*sparse COO"):
        torch.eye(2).to_sparse_csr().to("neuron")


def test_policies_reach_cpp_by_name_and_unknown_names_are_refused():
    from torchneuron import _C
    from torchneuron.hardware.config import DTYPE_POLICIES, FALLBACK_POLICIES

    for d in DTYPE_POLICIES:  # every name the configuration accepts, the core accepts
        for f in FALLBACK_POLICIES:
            _C._set_policies(d, f)
    _C._set_policies("trainium", "error")
    with pytest.raises(ValueError, match="unknown fallback policy 'loud'; valid values: 'warn', 'silent', 'error'"):
        _C._set_policies("host", "loud")
    with pytest.raises(ValueError, match="unknown dtype policy 'fp16'; valid values: 'trainium', 'host'"):
        _C._set_policies("fp16", "warn")
    with pytest.raises(NotImplementedError, match="TORCHNEURON_FALLBACK=error"):  # a refused call changed nothing
        torch.linalg.qr(torch.randn(3, 3, device="neuron"))
    x = torch.tensor([1 + 2**-40], dtype=torch.float64, device="neuron")
    assert x.item() == 1.0  # still the trainium dtype policy, not the refused "host"


def test_op_class_is_what_the_fallback_counts():
    from torchneuron import _C

    expected = {  # qualified name -> (base, native, exact, host_tensors), from the op table's documented classes
        "aten::add_.Tensor": ("add", True, False, False),
        "aten::add": ("add", True, False, False),
        "aten::index_put_": ("index_put", True, True, True),
        "aten::index.Tensor": ("index", True, True, True),
        "aten::cat.out": ("cat", True, True, False),
        "aten::__and__.Tensor": ("__and__", False, False, False),
        "aten::linalg_qr": ("linalg_qr", False, False, False),
    }
    for name, (base, native, exact, host) in expected.items():
        assert _C._op_class(name) == {"base": base, "native": native, "exact": exact, "host_tensors": host}, name
    a = torch.randn(4, 4, device="neuron")
    a.add_(a)
    torch.linalg.qr(a)
    a[torch.tensor([0, 1])] = 0.0  # host index tensor into a device op: allowed only where host_tensors
    executed, fallback = torchneuron.get_executed_ops(), torchneuron.get_fallback_ops()
    for op in [*executed, *fallback]:
        if op.startswith("aten::"):
            assert _C._op_class(op)["native"] == (op in executed) != (op in fallback), op
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a.add_(torch.ones(4, 4))  # add does not take host tensors


def test_op_counters_and_warn_once_are_exact_across_threads():
    import threading

    x = torch.ones(16, dtype=torch.float64, device="neuron")
    y = torch.ones(16, device="neuron")
    n_threads, calls = 4, 300
    torchneuron.clear_op_tracking()

    def work():
        for _ in range(calls):
            y.add(1)
            x.sin()  # float64 result: a dtype event per call, one warning in all

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=work) for _ in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert torchneuron.get_executed_ops()["aten::add"] == n_threads * calls
    assert torchneuron.get_dtype_events()["aten::sin"] == n_threads * calls
    assert sum("aten::sin produced float64" in str(w.message) for w in caught) == 1
