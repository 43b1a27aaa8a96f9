"""Ops whose input and output share memory behave as on the CPU: ATen's overlap checks raise the CPU's error for a
partial overlap (never a silently wrong result), and what the CPU allows gives the CPU's result. Eager, compiled,
and a property test over random in-place / out= / view programs."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchneuron

OVERLAP = "unsupported operation: some elements of the input tensor and the written-to tensor refer to a single"


@pytest.fixture(autouse=True)
def _quiet():
    torchneuron.set_policies("trainium", "silent")


def outcome(fn: Callable[[str], object], dev: str) -> tuple[str, object]:
    """("ok", results on the CPU) or (exception type, first line of its message)."""
    try:
        r = fn(dev)
    except Exception as e:  # noqa: BLE001 - the exception itself is what is compared
        return type(e).__name__, str(e).splitlines()[0]
    rs = r if isinstance(r, tuple) else (r,)
    return "ok", [t.cpu() for t in rs]


def assert_like_cpu(fn: Callable[[str], object]) -> tuple[str, object]:
    cpu, neuron = outcome(fn, "cpu"), outcome(fn, "neuron")
    assert cpu[0] == neuron[0], (cpu, neuron)
    if cpu[0] == "ok":
        for a, b in zip(cpu[1], neuron[1], strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    else:
        assert neuron[1] == cpu[1]
    return cpu


def ar(dev: str, n: int = 9) -> torch.Tensor:
    return torch.arange(float(n), device=dev)


def idx(dev: str, *values: int) -> torch.Tensor:
    return torch.tensor(values, device=dev)


def _setitem(d: str) -> torch.Tensor:
    x = ar(d, 5)
    x[1:] = x[:-1]
    return x


def _setitem_disjoint(d: str) -> torch.Tensor:
    x = ar(d, 6)
    x[:3] = x[3:]
    return x


# name -> (program, whether the CPU raises the overlap error)
CASES: dict[str, tuple[Callable[[str], object], bool]] = {
    "add_transpose": (lambda d: (lambda a: a.add_(a.t()))(ar(d).view(3, 3)), True),
    "add_self": (lambda d: (lambda a: a.add_(a))(ar(d)), False),
    "setitem_shifted": (_setitem, True),
    "setitem_disjoint": (_setitem_disjoint, False),
    "copy_transpose": (lambda d: (lambda a: a.copy_(a.t()))(ar(d).view(3, 3)), True),
    "neg_out_shifted": (lambda d: (lambda x: torch.neg(x[:-1], out=x[1:]))(ar(d)), True),
    "neg_out_self": (lambda d: (lambda x: torch.neg(x, out=x))(ar(d)), False),
    "mul_out_shifted": (lambda d: (lambda x: torch.mul(x[1:], x[1:], out=x[:-1]))(ar(d)), True),
    "gather_out_self": (lambda d: (lambda x: torch.gather(x, 0, idx(d, 2, 0, 1), out=x))(ar(d, 3)), True),
    "take_out_self": (lambda d: (lambda x: torch.take(x, idx(d, 2, 0, 1), out=x))(ar(d, 3)), True),
    "index_select_out_self": (lambda d: (lambda x: torch.index_select(x, 0, idx(d, 2, 0, 1), out=x))(ar(d, 3)),
                              True),
    "index_put_accumulate_from_self": (
        lambda d: (lambda x: x.index_put_((idx(d, 0, 1),), x[1:3], accumulate=True))(ar(d, 6)), True),
    "index_put_accumulate_from_clone": (
        lambda d: (lambda x: x.index_put_((idx(d, 0, 1),), x[1:3].clone(), accumulate=True))(ar(d, 6)), False),
    "cat_out_input": (lambda d: (lambda x: torch.cat([x, x], out=x))(ar(d, 4)), True),
    "cat_out_disjoint": (lambda d: (lambda x: (torch.cat([x[:2], x[:2]], out=x[4:]), x))(ar(d, 8)), False),
}


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("name", CASES)
def test_eager_overlap_matches_cpu(name: str):
    fn, raises = CASES[name]
    cpu = assert_like_cpu(fn)
    assert (cpu[0] == "RuntimeError" and cpu[1].startswith(OVERLAP)) == raises, cpu  # the case tests what it says


def test_the_written_tensor_is_untouched_when_the_check_raises():
    a = ar("neuron").view(3, 3)
    with pytest.raises(RuntimeError, match="single memory location"):
        a.add_(a.t())
    assert torch.equal(a.cpu(), ar("cpu").view(3, 3))


def test_internal_overlap_of_the_written_tensor():
    """An expanded (self-overlapping) output: the CPU's internal-overlap error."""
    assert_like_cpu(lambda d: ar(d, 1).expand(3).add_(1))
    assert_like_cpu(lambda d: torch.neg(ar(d, 3), out=ar(d, 1).expand(3)))


def _compiled_add_t(a):
    return a.add_(a.t())


def _compiled_setitem(x):
    x[1:] = x[:-1]
    return x


def _compiled_neg_out(x):
    return torch.neg(x[:-1], out=x[1:])


def _compiled_aliasing_inputs(x, y):
    return x.add_(y)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("fn, make", [
    (_compiled_add_t, lambda d: (ar(d).view(3, 3),)),
    (_compiled_setitem, lambda d: (ar(d, 5),)),
    (_compiled_neg_out, lambda d: (ar(d, 5),)),
    (_compiled_aliasing_inputs, lambda d: (lambda b: (b, b.t()))(ar(d).view(3, 3))),
], ids=["add_t", "setitem", "neg_out", "aliasing_inputs"])
def test_compiled_overlap_matches_cpu(fn, make):
    """torch.compile functionalizes mutations, so the CPU's compiled result (aot_eager, the same graphs on CPU
    kernels) is the reference; the neuron backend must give exactly that, inputs included."""
    results = {}
    for dev, backend in (("cpu", "aot_eager"), ("neuron", "neuron")):
        torch._dynamo.reset()
        args = make(dev)
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
        results[dev] = [t.cpu() for t in (out, *args)]
    for a, b in zip(results["cpu"], results["neuron"], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


# ---- property test: random programs over overlapping and disjoint views ----

N = 16  # elements of the shared base tensor


@st.composite
def views(draw, shape: tuple[int, ...]):
    """A view of the base with `shape` (a strided 1-d slice, or a square block maybe transposed), or of a
    separate tensor: ("base"|"other", start, step, transposed)."""
    owner = draw(st.sampled_from(["base", "base", "other"]))
    numel = 1
    for s in shape:
        numel *= s
    if len(shape) == 1:
        step = draw(st.sampled_from([1, 2]))
        start = draw(st.integers(0, N - 1 - step * (shape[0] - 1)))
        return owner, start, step, False
    return owner, draw(st.integers(0, N - numel)), 1, draw(st.booleans())


def make_view(spec, shape, base: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    owner, start, step, transposed = spec
    t = base if owner == "base" else other
    if len(shape) == 1:
        return t[start:start + step * (shape[0] - 1) + 1:step]
    v = t[start:start + shape[0] * shape[1]].view(shape)
    return v.t() if transposed else v


OPS: dict[str, Callable] = {
    "add_": lambda dst, src, i: dst.add_(src),
    "mul_": lambda dst, src, i: dst.mul_(src),
    "copy_": lambda dst, src, i: dst.copy_(src),
    "setitem": lambda dst, src, i: dst.__setitem__(Ellipsis, src),
    "neg_out": lambda dst, src, i: torch.neg(src, out=dst),
    "add_out": lambda dst, src, i: torch.add(src, dst, out=dst),
    "mul_out": lambda dst, src, i: torch.mul(src, 3, out=dst),
    "index_select_out": lambda dst, src, i: torch.index_select(src, 0, i, out=dst),
    "gather_out": lambda dst, src, i: torch.gather(src, 0, i.view(-1, *[1] * (src.dim() - 1)).expand_as(src),
                                                   out=dst),
    "take_out": lambda dst, src, i: torch.take(src, (i.view(-1, *[1] * (src.dim() - 1)) * 0 + i[0]).expand_as(src),
                                               out=dst),
    "index_put_acc": lambda dst, src, i: dst.index_put_((i,), src, accumulate=True),
    "index_put": lambda dst, src, i: dst.index_put_((i,), src),
}


@st.composite
def programs(draw):
    length = draw(st.integers(2, 3))
    shape = draw(st.sampled_from([(length,), (length, length)]))
    steps = draw(st.lists(st.tuples(st.sampled_from(sorted(OPS)), views(shape), views(shape),
                                    st.permutations(range(length)), st.booleans()), min_size=1, max_size=3))
    return shape, steps


def run_program(program, dev: str):
    shape, steps = program
    base, other = torch.arange(float(N), device=dev), torch.arange(float(N), device=dev) * -2 - 1
    results = []
    for op, dst_spec, src_spec, perm, host_index in steps:
        dst, src = make_view(dst_spec, shape, base, other), make_view(src_spec, shape, base, other)
        i = torch.tensor(perm, device="cpu" if host_index and op.startswith("index_put") else dev)
        results.append(OPS[op](dst, src, i))
    return (base, other, *[r for r in results if isinstance(r, torch.Tensor)])


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_overlap_programs_match_cpu(program):
    """neuron raises exactly when the CPU raises (same exception, same message) and otherwise matches it
    bit for bit, including every view's base."""
    assert_like_cpu(lambda dev: run_program(program, dev))
