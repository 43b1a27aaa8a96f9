"""What PyTorch's device-generic suites found (issue 30): lazy modules, the random ops' argument checks, the legacy
storage classes, and results the device cannot hold. Every expectation is the CPU's behaviour (or CUDA's, where
the CPU has none)."""
import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn

N = "neuron"


# ---- lazy modules: PyTorch converts parameters in place because the device answers for itself ----------------

LAZY = [
    (lambda: nn.LazyLinear(4), (2, 3)),
    (lambda: nn.LazyConv1d(4, 3), (2, 3, 8)),
    (lambda: nn.LazyConv2d(4, 3), (2, 3, 8, 8)),
    (lambda: nn.LazyConv3d(4, 3), (2, 3, 5, 5, 5)),
    (lambda: nn.LazyConvTranspose1d(4, 3), (2, 3, 8)),
    (lambda: nn.LazyConvTranspose2d(4, 3), (2, 3, 8, 8)),
    (lambda: nn.LazyConvTranspose3d(4, 3), (2, 3, 5, 5, 5)),
    (lambda: nn.LazyBatchNorm1d(), (4, 3)),
    (lambda: nn.LazyBatchNorm2d(), (4, 3, 5, 5)),
    (lambda: nn.LazyBatchNorm3d(), (4, 3, 2, 3, 3)),
    (lambda: nn.LazyInstanceNorm1d(affine=True, track_running_stats=True), (4, 3, 6)),
    (lambda: nn.LazyInstanceNorm2d(affine=True, track_running_stats=True), (4, 3, 5, 5)),
    (lambda: nn.LazyInstanceNorm3d(affine=True, track_running_stats=True), (4, 3, 2, 3, 3)),
    (lambda: nn.Sequential(nn.LazyConv2d(4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2)), (2, 3, 6, 6)),
]


@pytest.mark.parametrize("i", range(len(LAZY)))
def test_lazy_module_moved_before_its_first_forward_matches_the_cpu(i):
    make, shape = LAZY[i]
    cpu, dev = make(), make().to(N)  # (uninitialised buffers cannot be deep-copied)
    uninit = [p for p in (*dev.parameters(), *dev.buffers()) if isinstance(p, nn.parameter.UninitializedTensorMixin)]
    assert uninit and all(p.device.type == N for p in uninit)  # still uninitialised, now on the device
    x = torch.randn(shape)
    cpu(x)  # both initialise at their first forward
    dev(x.to(N))
    assert not any(isinstance(p, nn.parameter.UninitializedTensorMixin) for p in (*dev.parameters(), *dev.buffers()))
    for (name, p), (_, q) in zip(dev.named_parameters(), cpu.named_parameters(), strict=True):
        assert p.device.type == N and p.shape == q.shape and p.dtype == q.dtype, name
    dev.load_state_dict(cpu.state_dict())  # the initial values come from each device's generator
    x = torch.randn(shape)
    torch.testing.assert_close(dev(x.to(N)).cpu(), cpu(x), rtol=1e-5, atol=1e-5)


def test_shallow_copy_between_host_and_device_is_what_cuda_gets():
    """`param.data = t` across the host/neuron boundary works as across CPU/CUDA; sparse and dense stay apart."""
    p = nn.Parameter(torch.randn(3))
    p.data = torch.ones(3, device=N)
    assert p.device.type == N and isinstance(p, nn.Parameter) and p.cpu().tolist() == [1.0, 1.0, 1.0]
    assert torch._has_compatible_shallow_copy_type(torch.empty(1), torch.empty(1, device=N))
    assert torch._has_compatible_shallow_copy_type(torch.empty(1, device=N), torch.empty(1))
    assert not torch._has_compatible_shallow_copy_type(torch.empty(1, device=N), torch.empty(1).to_sparse())
    lin = nn.Linear(2, 2)
    weight = lin.weight
    assert lin.to(N).weight is weight and lin.cpu().weight is weight


def test_meta_module_moves_and_materialises_as_on_the_cpu():
    m = nn.Linear(3, 2, device="meta")
    with pytest.raises(NotImplementedError) as cpu_err:
        copy.deepcopy(m).to("cpu")
    with pytest.raises(NotImplementedError) as dev_err:
        m.to(N)
    assert str(dev_err.value) == str(cpu_err.value)
    m.to_empty(device=N)
    assert m.weight.device.type == N and m(torch.ones(1, 3, device=N)).shape == (1, 2)


# ---- random ops: every argument check is the CPU's --------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64]
CALLS = {
    "uniform_": [(), (0, 1), (1, 0), (-3e38, 3e38), (-1e39, 0), (0, 70000), (-1, -1)],
    "normal_": [(), (0, 1), (0, -1), (3, 0)],
    "log_normal_": [(), (1, 2), (1, 0), (1, -1)],
    "exponential_": [(), (1.5,), (0.0,), (-1.0,)],
    "cauchy_": [(), (0, 1), (0, 0), (0, -1)],
    "geometric_": [(0.5,), (0.0,), (1.0,), (1.5,)],
    "bernoulli_": [(), (0.5,), (-0.1,), (1.1,)],
    "random_": [(), (10,), (0, 200), (-1, 5), (5, 5), (300,), (0, 2**25), (-2**63,), (0, 2**40), (2**53,),
                (-200, -100), (2**24 + 1,), (0, 2**60)],
}


def _outcome(device, dtype, op, args, numel):
    """What the call does: ("ok", warnings) or (exception type, message, warnings)."""
    t = torch.zeros(numel, dtype=dtype, device=device)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            getattr(t, op)(*args)
            out = ("ok",)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            out = (type(e).__name__, str(e).split("\n")[0])
    return out + (sorted({str(x.message) for x in w if "precision" in str(x.message) or "bounds" in str(x.message)}),)


@pytest.mark.parametrize("op", sorted(CALLS))
def test_random_ops_check_their_arguments_as_the_cpu_does(op):
    mismatches = []
    for dtype in DTYPES:
        for args in CALLS[op]:
            for numel in (4, 0):
                cpu, dev = _outcome("cpu", dtype, op, args, numel), _outcome(N, dtype, op, args, numel)
                if cpu != dev:
                    mismatches.append((dtype, args, numel, cpu, dev))
    assert mismatches == []


def test_random_precision_warning_and_ranges_in_the_dtype():
    with pytest.warns(UserWarning, match="Due to precision limitations"):
        torch.empty(4, device=N).random_(0, 2**25)
    cases = [(torch.float16, 0, 65504), (torch.bfloat16, 0, 2**20), (torch.float32, 0, 2**25),
             (torch.int8, -128, 128), (torch.uint8, 0, 256), (torch.float16, -65504, 0)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype, lo, hi in cases:
            v = torch.empty(20000, dtype=dtype, device=N).random_(lo, hi).cpu().double()
            assert lo <= v.min() and v.max() < hi, (dtype, lo, hi, v.min(), v.max())
            assert v.unique().numel() > 50  # spread over the range, not stuck at a bound
    for lo, hi, what in [(-200, 0, "from"), (0, 200, "to - 1")]:  # raised where the CPU silently wrapped before
        with pytest.raises(RuntimeError, match=f"{what} is out of bounds for") as dev:
            torch.empty(4, dtype=torch.int8, device=N).random_(lo, hi)
        with pytest.raises(RuntimeError) as cpu:
            torch.empty(4, dtype=torch.int8).random_(lo, hi)
        assert str(dev.value) == str(cpu.value)


def test_random_ops_refuse_overlapping_elements_and_check_tensor_probabilities():
    for op, args in [("uniform_", ()), ("normal_", ()), ("random_", (0, 5)), ("bernoulli_", (0.5,)),
                     ("exponential_", ())]:
        for device in ("cpu", N):
            with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
                getattr(torch.zeros(1, device=device).expand(3), op)(*args)
    for self_shape, p_shape, p_dtype in [((4,), (3,), torch.float), ((4,), (4,), torch.int32),
                                         ((2, 3), (3,), torch.float)]:
        outcomes = []
        for device in ("cpu", N):
            try:
                torch.zeros(self_shape, device=device).bernoulli_(torch.full(p_shape, 0, dtype=p_dtype, device=device))
                outcomes.append("ok")
            except Exception as e:  # noqa: BLE001
                outcomes.append(type(e).__name__)
        assert outcomes[0] == outcomes[1], (self_shape, p_shape, p_dtype, outcomes)


# ---- legacy storage classes, as torch.cuda's --------------------------------------------------------------------

LEGACY = [(d, n) for d, n in torch.storage._dtype_to_storage_type_map().items()
          if d not in (torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4)]


@pytest.mark.parametrize("dtype,name", LEGACY, ids=[n for _, n in LEGACY])
def test_storage_type_is_the_devices_legacy_class(dtype, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        t = torch.zeros(3, dtype=dtype, device=N)
        cls = t.storage_type()
        assert cls is getattr(torch.neuron, name) and cls.__module__ == "torch.neuron" and cls.__name__ == name
        assert torch.zeros(3, dtype=dtype).storage_type() is getattr(torch, name)  # the CPU's stays the CPU's
        assert isinstance(t.storage(), cls) and not isinstance(torch.zeros(3, dtype=dtype).storage(), cls)
        assert t.storage().type() == f"torch.neuron.{name}"
        s = cls(5)
        assert s.device.type == N and s.dtype == dtype and s.size() == 5 and torch.is_storage(s)
        assert cls in torch._storage_classes and cls.dtype == dtype


def test_storage_apis_behave_as_cudas():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = torch.arange(4.0, device=N)
        with pytest.raises(RuntimeError, match="from_buffer: Not available for neuron storage"):
            torch.neuron.FloatStorage.from_buffer(b"\0" * 8)
        with pytest.raises(TypeError, match="only CPU memory can be pinned"):
            x.untyped_storage().pin_memory()
        assert not x.untyped_storage().is_pinned() and x.storage().device == x.device
        shared = torch.UntypedStorage._new_shared(16, device=N)
        assert shared.device.type == N and shared.nbytes() == 16
        assert x.untyped_storage().share_memory_() is not None  # a no-op for device memory, as CUDA's
        assert x.storage().cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
        assert torch.neuron.FloatStorage(2).copy_(torch.FloatStorage([5.0, 6.0])).tolist() == [5.0, 6.0]


# ---- results the device cannot hold are refused at the call ----------------------------------------------------

def test_quantized_and_nested_results_are_refused_at_the_call():
    x = torch.randn(4, device=N)
    calls = {
        "quantize_per_tensor": lambda: torch.quantize_per_tensor(x, 0.1, 0, torch.quint8),
        "quantize_per_tensor.tensor_qparams": lambda: torch.quantize_per_tensor(
            x, torch.tensor(0.1, device=N), torch.tensor(0, device=N), torch.quint8),
        "quantize_per_tensor_dynamic": lambda: torch.quantize_per_tensor_dynamic(x, torch.quint8, False),
        "quantize_per_channel": lambda: torch.quantize_per_channel(
            x.view(2, 2), torch.tensor([0.1, 0.2], device=N), torch.tensor([0, 0], device=N), 0, torch.qint8),
        "empty": lambda: torch.empty(3, dtype=torch.quint8, device=N),
        "_empty_affine_quantized": lambda: torch._empty_affine_quantized([3], scale=0.1, zero_point=0,
                                                                          dtype=torch.quint8, device=N),
        "to": lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.quint8).to(N),
    }
    for name, call in calls.items():
        with pytest.raises(NotImplementedError, match="neuron: .*quantized") as e:
            call()
        assert "strided" in str(e.value), name
    nt = torch.nested.nested_tensor([torch.ones(2, device=N), torch.ones(3, device=N)])
    with pytest.raises(NotImplementedError, match="neuron: nested tensors are not supported"):
        nt.cpu()
    # float results of quantization arithmetic are ordinary tensors and match the CPU
    cpu = torch.fake_quantize_per_tensor_affine(x.cpu(), 0.1, 0, 0, 255)
    assert torch.equal(torch.fake_quantize_per_tensor_affine(x, 0.1, 0, 0, 255).cpu(), cpu)


def test_half_precision_reductions_give_the_cpus_answer_when_threads_fill_the_cores():
    """Item 5: a float16/bfloat16 reduction rounds each thread's partial sum to its dtype, so its value follows the
    thread split. Such kernels run with the launching thread's count (not one thread fewer, which the device uses
    for small kernels when threads fill the cores), so they split, and round, as the CPU does at that count. The
    cases are 40K-element strided float16 views whose CPU result at one thread fewer differs."""
    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip("one core: no thread fewer")
    saved = torch.get_num_threads()
    cases = []
    try:
        for seed in range(5):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(400, 200, generator=g).half()[:, ::2]
            for op in (torch.nansum, torch.sum):
                torch.set_num_threads(cores - 1)
                fewer = op(x)
                torch.set_num_threads(cores)
                cpu, dev = op(x), op(x.to(N)).cpu()
                cases.append(not torch.equal(fewer, cpu))
                assert torch.equal(dev, cpu), (seed, op.__name__, dev.item(), cpu.item(), fewer.item())
    finally:
        torch.set_num_threads(saved)
    assert any(cases), "premise: some case rounds differently at one thread fewer"
