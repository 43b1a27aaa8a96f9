"""The unboxed fast paths of the hot pointwise ops (csrc/fastpath.cpp) against the CPU: values, dtypes, shapes and
strides, on an idle stream (the fast path) and a busy one (queued by the boxed fallback), with every device rule
the boxed fallback applies."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torchneuron

DEV = "neuron"

# name -> (function of the inputs, arity, accepts integer dtypes)
OPS = {
    "add": (lambda a, b: a + b, 2, True),
    "add_alpha": (lambda a, b: torch.add(a, b, alpha=3), 2, True),
    "sub": (lambda a, b: torch.sub(a, b, alpha=2), 2, True),
    "mul": (lambda a, b: a * b, 2, True),
    "div": (lambda a, b: a / b, 2, True),
    "div_floor": (lambda a, b: torch.div(a, b, rounding_mode="floor"), 2, True),
    "maximum": (torch.maximum, 2, True),
    "minimum": (torch.minimum, 2, True),
    "pow": (lambda a, b: torch.pow(a.abs(), b), 2, False),
    "pow_scalar": (lambda a: a ** 2, 1, True),
    "neg": (torch.neg, 1, True),
    "exp": (torch.exp, 1, False),
    "log": (lambda a: torch.log(a.abs()), 1, False),
    "sqrt": (lambda a: torch.sqrt(a.abs()), 1, False),
    "rsqrt": (lambda a: torch.rsqrt(a.abs()), 1, False),
    "tanh": (torch.tanh, 1, False),
    "sigmoid": (torch.sigmoid, 1, False),
    "silu": (F.silu, 1, False),
    "gelu": (F.gelu, 1, False),
    "gelu_tanh": (lambda a: F.gelu(a, approximate="tanh"), 1, False),
    "relu_backward": (lambda g, a: torch.ops.aten.threshold_backward(g, a, 0.0), 2, False),
    "tanh_backward": (torch.ops.aten.tanh_backward, 2, False),
    "sigmoid_backward": (torch.ops.aten.sigmoid_backward, 2, False),
    "silu_backward": (torch.ops.aten.silu_backward, 2, False),
    "gelu_backward": (torch.ops.aten.gelu_backward, 2, False),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32]


NO_SCALAR = {"maximum", "minimum", "relu_backward", "tanh_backward", "sigmoid_backward", "silu_backward",
             "gelu_backward"}  # their second operand must be a tensor


def make(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) + 0.1).to(dtype)
    return torch.randint(1, 9, shape, generator=g, dtype=dtype)


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """The device result is the CPU kernel's: dtype, shape, strides and values (bit-exact: the same kernel; float64
    results carry float32 precision under the trainium rules)."""
    assert got.device.type == DEV
    if want.dtype == torch.float64:
        want = want.float().double()
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


def check(fn, *cpu_args, host=()):
    """`host`: the positions of tensors passed as CPU values (0-dim) to the device op too."""
    dev_args = [a.to(DEV) if isinstance(a, torch.Tensor) and i not in host else a for i, a in enumerate(cpu_args)]
    torch.neuron.synchronize()
    same(fn(*dev_args), fn(*cpu_args))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", OPS)
def test_fast_op_equals_cpu(name, dtype):
    fn, arity, ints = OPS[name]
    if not dtype.is_floating_point and not ints:
        pytest.skip("float-only op")
    args = [make((4, 5), dtype, i) for i in range(arity)]
    check(fn, *args)
    if arity == 2 and name != "gelu_backward":  # broadcasting (the CPU's gelu_backward refuses it), 0-dim device
        # tensors, wrapped-number scalars
        check(fn, make((4, 1), dtype, 3), make((5,), dtype, 4))
        check(fn, make((), dtype, 5), make((3,), dtype, 6))
        if name not in NO_SCALAR:
            check(fn, make((3, 2), dtype, 7), 2 if not dtype.is_floating_point else 1.5)


VIEWS = {  # the same view of the same values on both devices
    "transposed": ((6, 8), lambda t: t.t()),
    "sliced": ((6, 8), lambda t: t[::2, 1::3]),
    "channels_last": ((2, 3, 4, 5), lambda t: t.contiguous(memory_format=torch.channels_last)),
    "expanded": ((1, 8), lambda t: t.expand(6, 8)),  # overlapping: one element read many times
    "strided_overlap": ((16,), lambda t: t.as_strided((4, 4), (2, 1))),
}


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("name", ["add", "mul", "div", "gelu", "neg", "maximum"])
def test_layouts_equal_cpu(name, view):
    """Non-contiguous, channels-last and overlapping inputs give the CPU's strides; a result never aliases an
    input."""
    fn, arity, _ = OPS[name]
    shape, v = VIEWS[view]
    x = v(make(shape, torch.float32, 0))
    xd = v(make(shape, torch.float32, 0).to(DEV))
    assert xd.stride() == x.stride()
    others = [make(x.shape, torch.float32, 9)] * (arity - 1)
    got, want = fn(xd, *[o.to(DEV) for o in others]), fn(x, *others)
    same(got, want)
    assert got.untyped_storage().data_ptr() != xd.untyped_storage().data_ptr()
    a = make((5,), torch.float32, 3).to(DEV)
    same(fn(*[a] * arity), fn(*[a.cpu()] * arity))  # the same tensor twice


@pytest.mark.parametrize("a,b", [(torch.int32, torch.float32), (torch.bfloat16, torch.float32),
                                 (torch.int64, torch.int32), (torch.bool, torch.int32)], ids=str)
def test_type_promotion_equals_cpu(a, b):
    x, y = make((3, 4), a, 0), make((3, 4), b, 1)
    for fn in (OPS["add"][0], OPS["mul"][0], OPS["div"][0]):
        check(fn, x, y)
        check(fn, x, 2.5)
        check(fn, x, torch.tensor(3, dtype=torch.float64), host=(1,))  # a 0-dim CPU tensor of a higher category


@pytest.mark.parametrize("exponent", [0, 1, 0.5, -1, 3, 2.0], ids=str)
def test_pow_scalar_special_exponents_equal_cpu(exponent):
    """pow's CPU kernel fills (exponent 0) or copies (exponent 1) its result instead of computing it: on the
    direct path those are device ops called from inside the fast kernel."""
    check(lambda a: torch.pow(a, exponent), make((3, 5), torch.float32, 0).abs())
    check(lambda a: torch.pow(a, exponent), make((3, 5), torch.bfloat16, 1).abs())


def test_float64_under_the_host_policy_equals_cpu():
    torchneuron.set_policies("host", "warn")  # the fixture restores the default
    for name in ("add", "mul", "div", "exp", "tanh", "silu_backward"):
        fn, arity, _ = OPS[name]
        args = [make((4, 5), torch.float64, i) for i in range(arity)]
        got = fn(*[a.to(DEV) for a in args])
        assert got.dtype == torch.float64
        torch.testing.assert_close(got.cpu(), fn(*args), rtol=0, atol=0)  # full precision, bit for bit


def test_a_tensor_on_another_device_than_the_current_one():
    if torch.neuron.device_count() < 2:
        pytest.skip("one device")
    x = make((4, 5), torch.float32, 0).to("neuron:1")
    before = torch.neuron.memory_allocated(1), torch.neuron.memory_allocated(0)
    y = torch.tanh(x) + x
    assert y.device == torch.device("neuron:1") and torch.neuron.current_device() == 0
    assert torch.neuron.memory_allocated(1) > before[0] and torch.neuron.memory_allocated(0) == before[1]
    same(y, torch.tanh(x.cpu()) + x.cpu())


def test_idle_runs_at_once_busy_is_queued_and_both_are_counted():
    x = make((16,), torch.float32, 0).to(DEV)
    torch.neuron.synchronize()
    torchneuron.clear_op_tracking()
    same(x + x, x.cpu() * 2)
    assert torchneuron.get_executed_ops().get("aten::add") == 1
    assert "aten::add" not in torchneuron._C._queued_ops()
    big = make((512, 512), torch.float32, 1).to(DEV)
    for _ in range(2):  # the second busy call has the signature's layout: it is queued
        slow = [big @ big for _ in range(4)]
        y = torch.tanh(x)
        assert torch.equal(y.cpu(), torch.tanh(x.cpu()))
    assert torchneuron._C._queued_ops().get("aten::tanh", 0) >= 1
    assert torchneuron.get_executed_ops().get("aten::tanh") == 2
    del slow


def test_device_mismatch_raises_the_fallback_message():
    x = torch.ones(3, device=DEV)
    with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device.*neuron:0 and cpu"):
        x + torch.ones(3)
    if torch.neuron.device_count() > 1:
        with pytest.raises(RuntimeError, match=r"same device.*neuron:0 and neuron:1"):
            x * torch.ones(3, device="neuron:1")


def test_shape_mismatch_raises_the_cpu_message():
    with pytest.raises(RuntimeError, match=r"The size of tensor a \(3\) must match the size of tensor b \(4\)"):
        torch.ones(3, device=DEV) + torch.ones(4, device=DEV)


def test_trainium_fp64_and_int64_rules_counted_as_before():
    x = torch.tensor([1 + 2 ** -40], dtype=torch.float64)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        xd = x.to(DEV)
        torchneuron.clear_op_tracking()
        y = xd + xd
    assert y.dtype == torch.float64 and y.cpu().item() == 2.0  # float32 precision
    assert torchneuron.get_dtype_events().get("aten::add") == 1
    big = torch.tensor([2 ** 31 - 1], dtype=torch.int64, device=DEV)
    with pytest.warns(UserWarning, match="outside the int32 range"):
        z = big + big
    assert z.cpu().item() == 2 ** 32 - 2 and torchneuron.get_dtype_events().get("aten::add") == 2
    torchneuron.set_policies("host", "warn")
    torchneuron.clear_op_tracking()
    assert (xd + 0.5).cpu().item() == 1.5 and not torchneuron.get_dtype_events()


def test_autograd_through_fast_ops_equals_cpu():
    def f(a, b):
        h = F.gelu(a * b + a) / (b.abs() + 1)
        return (torch.tanh(h) - torch.sigmoid(h) + F.silu(-h) + torch.maximum(h, a).exp()).sum()

    a, b = make((4, 6), torch.float32, 0), make((4, 6), torch.float32, 1)
    grads = []
    for dev in ("cpu", DEV):
        x, y = a.to(dev).detach().requires_grad_(), b.to(dev).detach().requires_grad_()
        out = f(x, y)
        out.backward()
        assert out.requires_grad and out.grad_fn is not None
        grads.append((x.grad.cpu(), y.grad.cpu()))
    torch.testing.assert_close(grads[1], grads[0])


def test_a_fast_op_after_a_failed_kernel_computes_and_the_error_waits_for_a_sync_point():
    """An independent fast op after a failed queued kernel is no sync point: it computes (docs/device.md, errors),
    and the kernel's error surfaces at the next sync point."""
    src, good = torch.randn(8, 4, device=DEV), torch.tensor([0, 1], device=DEV)
    bad, one = torch.tensor([0, 99], device=DEV), torch.ones(2, device=DEV)
    torch.index_select(src, 0, good)  # the signature's layout is known: the next call is queued
    big = torch.randn(512, 512, device=DEV)
    _ = [big @ big for _ in range(3)]
    torch.index_select(src, 0, bad)
    while not torch.neuron.current_stream().query():
        pass
    out = one + 1
    with pytest.raises(IndexError, match="index_select"):
        torch.neuron.synchronize()
    assert torch.equal(out.cpu(), torch.full((2,), 2.0))


def _busy() -> list[torch.Tensor]:
    big = torch.randn(512, 512, device=DEV)
    return [big @ big for _ in range(3)]


def test_launch_stack_names_the_innermost_frames_of_a_deep_stack():
    """A queued kernel's error names the innermost 12 frames of the stack that launched it (gathered cheaply at
    every queued launch, csrc/launch_stack.cpp), most recent call last."""
    src, good, bad = torch.randn(8, 4, device=DEV), torch.tensor([0, 1], device=DEV), torch.tensor([0, 99], device=DEV)
    torch.index_select(src, 0, good)  # the signature's layout is known: the next call is queued

    def nested(depth):
        if depth:
            return nested(depth - 1)
        busy = _busy()
        out = torch.index_select(src, 0, bad)  # LAUNCH
        return out, busy

    nested(20)
    with pytest.raises((RuntimeError, IndexError)) as info:
        torch.neuron.synchronize()
    frames = str(info.value).split("It was launched from (most recent call last):")[1].split("\n(Set")[0]
    lines = [ln for ln in frames.splitlines() if ln.strip()]
    assert len(lines) == 12 and all("in nested" in ln for ln in lines)
    launch = next(i for i, ln in enumerate(open(__file__), 1) if ln.rstrip().endswith("# LAUNCH"))
    assert lines[-1].endswith(f"line {launch}, in nested")


def test_launch_stacks_release_their_code_objects():
    """The frames a launch keeps are released once its kernel has run (no code object lives on because a kernel was
    once launched from it)."""
    import sys

    x = torch.randn(1 << 16, device=DEV)
    x + x  # the signature's layout
    ns: dict = {}
    exec(compile("def launch(x):\n    return x + x\n", "<generated>", "exec"), ns)
    code = ns["launch"].__code__
    before = sys.getrefcount(code)
    busy = _busy()
    outs = [ns["launch"](x) for _ in range(50)]  # queued behind the busy stream: each keeps `code`
    assert torchneuron._C._queued_ops().get("aten::add", 0) >= 50
    torch.neuron.synchronize()
    del busy, outs
    x + x  # a later launch releases the finished kernels' stacks
    assert sys.getrefcount(code) == before
