"""Device rules at the edges, as CUDA behaves: device checks in explicit kernels, layouts the device refuses,
set_ across devices, host memory exhaustion, visible-core lists, and the Trainium dtype rules for values that
enter the device through op arguments or collectives, and for PyTorch's own printing."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import run_py
from dist_helpers import init, launch

import torchneuron
from torchneuron.hardware.config import ConfigError, parse_core_list

SAME_DEVICE = "Expected all tensors to be on the same device"
THIRD_F32 = float(torch.tensor(1 / 3, dtype=torch.float32))


# ---- item 3: every explicit kernel checks devices ----

CONVS = {
    "conv1d": (F.conv1d, (1, 2, 5), (3, 2, 2)),
    "conv2d": (F.conv2d, (1, 2, 5, 5), (3, 2, 2, 2)),
    "conv_transpose2d": (F.conv_transpose2d, (1, 3, 4, 4), (3, 2, 2, 2)),
}


@pytest.mark.parametrize("conv", CONVS)
@pytest.mark.parametrize("where", ["weight_cpu", "weight_neuron1", "bias_cpu", "bias_neuron1", "input_cpu"])
def test_convolution_checks_devices(conv: str, where: str):
    fn, xs, ws = CONVS[conv]
    x, w = torch.randn(xs, device="neuron"), torch.randn(ws, device="neuron")
    b = torch.randn(w.shape[1] if conv.startswith("conv_t") else w.shape[0], device="neuron")
    other = "cpu" if where.endswith("cpu") else "neuron:1"
    if where.startswith("weight"):
        w = w.to(other)
    elif where.startswith("bias"):
        b = b.to(other)
    else:
        x = x.cpu()
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        fn(x, w, b)


def test_convolution_on_one_device_still_matches_cpu():
    x, w, b = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 2, 2), torch.randn(3)
    got = F.conv2d(x.neuron(), w.neuron(), b.neuron())
    torch.testing.assert_close(got.cpu(), F.conv2d(x, w, b), rtol=0, atol=0)


def test_convolution_backward_checks_devices():
    x, w = torch.randn(1, 2, 5, 5, device="neuron"), torch.randn(3, 2, 2, 2, device="neuron")
    g = torch.randn(1, 3, 4, 4)  # a gradient left on the host
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.ops.aten.convolution_backward(g, x, w, [3], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                            [True, True, True])


# ---- item 8: sparse compressed layouts are refused at the move ----

SPARSE = {
    "csr": lambda x: x.to_sparse_csr(), "csc": lambda x: x.to_sparse_csc(),
    "bsr": lambda x: x.to_sparse_bsr((2, 2)), "bsc": lambda x: x.to_sparse_bsc((2, 2)),
}


@pytest.mark.filterwarnings("ignore:Sparse")
@pytest.mark.parametrize("layout", SPARSE)
def test_sparse_compressed_layouts_raise_at_the_move(layout: str):
    s = SPARSE[layout](torch.eye(4))
    name = {"csr": "SparseCsr", "csc": "SparseCsc", "bsr": "SparseBsr", "bsc": "SparseBsc"}[layout]
    for move in (lambda: s.to("neuron"), lambda: s.neuron(), lambda: s.to("neuron", torch.float64)):
        with pytest.raises(NotImplementedError, match=f"neuron: {name} tensors are not supported"):
            move()
    assert torch.equal(s.to(torch.float64).to_dense(), torch.eye(4, dtype=torch.float64))  # CPU moves unaffected


@pytest.mark.filterwarnings("ignore:Sparse")
def test_sparse_compressed_constructors_and_conversions_on_neuron_raise():
    crow, col, val = torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([1.0])
    with pytest.raises(NotImplementedError, match="sparse compressed"):
        torch.sparse_csr_tensor(crow, col, val, device="neuron")
    with pytest.raises(NotImplementedError, match="sparse compressed"):
        torch.sparse_compressed_tensor(crow, col, val, (1, 1), layout=torch.sparse_csc, device="neuron")
    with pytest.raises(NotImplementedError, match="SparseCsr"):
        torch.eye(2, device="neuron").to_sparse_csr()


# ---- item 11: set_, host OOM, visible cores ----

def test_set_onto_another_devices_storage_raises_like_cuda():
    t = torch.zeros(3, device="neuron")
    for storage in (torch.zeros(3, device="neuron:1").untyped_storage(), torch.zeros(3).untyped_storage()):
        with pytest.raises(RuntimeError, match='Attempted to set the storage of a tensor on device "neuron:0" to a '
                                               'storage on different device'):
            t.set_(storage)
        with pytest.raises(RuntimeError, match="devices must match"):
            t.set_(storage, 0, (3,), (1,))
    with pytest.raises(RuntimeError, match="devices must match"):
        t.set_(torch.zeros(3, device="neuron:1"))
    assert t.device == torch.device("neuron:0")
    s = torch.arange(4.0, device="neuron")
    t.set_(s.untyped_storage(), 1, (2,), (1,))  # same device: works
    assert t.tolist() == [1.0, 2.0]


def test_host_allocation_failure_is_out_of_memory():
    """A CPU kernel whose result the host cannot allocate (address space capped) raises torch.OutOfMemoryError
    naming the device, the process keeps working, and the OOM is counted."""
    p = run_py("""
        import resource, torch
        a = torch.ones(2**16, device="neuron")
        with open("/proc/self/status") as f:
            vm = int(next(l for l in f if l.startswith("VmSize")).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))
        try:
            torch.outer(a, a)  # 16 GiB from the CPU kernel's allocator
        except torch.OutOfMemoryError as e:
            print("OOM", e)
        print("after", (a + 1).sum().item(), torch.neuron.memory_stats()["num_ooms"])
    """, env={"TORCHNEURON_FALLBACK": "silent"})
    assert "OOM neuron:0 out of memory: tried to allocate 16.00 GiB" in p.stdout, p.stdout
    assert "The host could not provide the memory" in p.stdout
    assert "after 131072.0 1" in p.stdout


def test_repeated_visible_cores_are_rejected():
    for text in ("1,1", "0-2,2", "0, 3, 0"):
        with pytest.raises(ConfigError, match="more than once"):
            parse_core_list(text, 8)
    assert parse_core_list("0-2,5", 8) == [0, 1, 2, 5]


# ---- item 11: the float64 rule for host values entering ops; int64 events ----

def test_host_values_entering_float64_ops_carry_float32_precision():
    x = torch.zeros(4, dtype=torch.float64, device="neuron")
    with pytest.warns(UserWarning, match="aten::fill_ received float64 host values"):
        x.fill_(1 / 3)
    assert x[0].item() == THIRD_F32
    assert torch.full((2,), 1 / 3, dtype=torch.float64, device="neuron")[0].item() == THIRD_F32
    x[1] = 1 / 3  # a Python number through setitem
    assert x[1].item() == THIRD_F32
    y = torch.zeros(3, dtype=torch.float64, device="neuron")
    with pytest.warns(UserWarning, match="aten::_index_put_impl_ received float64"):
        y.index_put_((torch.tensor([1]),), torch.tensor(1 / 3, dtype=torch.float64))  # a CPU value tensor
    assert y[1].item() == THIRD_F32
    z = torch.ones(2, dtype=torch.float64, device="neuron").mul_(1 / 3)  # non-exact op: the scalar is rounded too
    assert z[0].item() == THIRD_F32
    events = torchneuron.get_dtype_events()
    assert events["aten::fill_"] == 3 and events["aten::_index_put_impl_"] == 1 and events["aten::mul_"] == 1
    cpu = torch.zeros(1, dtype=torch.float64)
    cpu.fill_(1 / 3)
    assert cpu.item() == 1 / 3  # a CPU value tensor is never modified in place


def test_exact_host_values_and_float32_ops_are_not_events(no_warnings):
    x = torch.zeros(4, dtype=torch.float64, device="neuron")
    x.fill_(0.5)
    x[0] = 2.0
    torch.full((2,), 0.25, dtype=torch.float64, device="neuron")
    f = torch.zeros(3, device="neuron")
    f.fill_(1 / 3)
    f.mul_(0.1)
    assert x.tolist() == [2.0, 0.5, 0.5, 0.5]
    assert torchneuron.get_dtype_events() == {}


def test_host_policy_keeps_host_values_exact(no_warnings):
    torchneuron.set_policies("host")
    x = torch.zeros(2, dtype=torch.float64, device="neuron").fill_(1 / 3)
    assert x[0].item() == 1 / 3 and torchneuron.get_dtype_events() == {}


def test_int64_range_events_are_counted():
    big = torch.tensor([2**40])
    with pytest.warns(UserWarning, match="outside the int32 range"):
        d = big.neuron()
    with pytest.warns(UserWarning, match="aten::add produced int64"):
        d + 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per op, counted every time
        d + 2
        torch.arange(5, device="neuron") + 1  # in range: no event
    events = torchneuron.get_dtype_events()
    assert events["aten::copy_ (host to neuron)"] == 1 and events["aten::add"] == 2


# ---- printing is not the user's program ----

def test_printing_does_not_report_dtype_events():
    """torch/_tensor_str.py formats through float64 math; the first print of a float32 tensor must not warn."""
    x = torch.randn(3, device="neuron")
    with pytest.warns(UserWarning, match="float64 data copied"):
        d = torch.tensor([1 / 3, 1e-9], dtype=torch.float64, device="neuron")  # the user's own float64: warned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert str(x) == str(x.cpu()).replace(")", ", device='neuron:0')")
        assert repr(d) == repr(d.cpu()).replace(", dtype", ", device='neuron:0', dtype")
    assert torchneuron.get_dtype_events() == {"aten::copy_ (host to neuron)": 1}  # only the user's copy


def test_user_float64_math_still_warns_after_printing():
    x = torch.ones(2, dtype=torch.float64, device="neuron")
    print(x / 7)
    assert torchneuron.get_dtype_events()["aten::div"] == 1


# ---- float64 reductions of collectives ----

def _allreduce_f64() -> list[float]:
    import torch.distributed as dist
    r, _ = init()
    t = torch.tensor([1 / 3 if r == 0 else 1e-9], dtype=torch.float64, device="neuron")
    dist.all_reduce(t)
    u = torch.tensor([1 / 3 if r == 0 else 1e-9], dtype=torch.float64, device="neuron")
    dist.all_reduce(u, op=dist.ReduceOp.AVG)
    events = torchneuron.get_dtype_events()
    dist.destroy_process_group()
    return [t.item(), u.item(), events.get("c10d::all_reduce", 0)]


@pytest.mark.slow
def test_float64_all_reduce_carries_float32_precision():
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
    total = f32(f32(1 / 3) + f32(1e-9))
    for got in launch("test_device_rules.py::_allreduce_f64", 2):
        assert got == [total, f32(total / 2), 2]
