"""The execution path of every launch, counted (torchneuron.get_execution_paths(), docs/device.md's table): each
path is reached by the launch that should take it, and by no other, and the values are the CPU's."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import Gate

import torchneuron

PATHS = {"fast", "now", "host", "first_call", "queued_out", "queued_each", "queued_copy", "kernel", "compiled",
         "fused"}


def taken(run: Callable[[], object]) -> dict[str, int]:
    """The paths `run`'s launches took (only the non-zero counts)."""
    before = torchneuron.get_execution_paths()
    run()
    after = torchneuron.get_execution_paths()
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.fixture(autouse=True)
def idle():
    if torchneuron._C._launch_blocking() or torchneuron._C._queue_everything():
        pytest.skip("the default execution mode's paths")
    torch.neuron.synchronize()


def test_every_path_is_named_and_counted_from_zero_after_a_clear():
    assert set(torchneuron.get_execution_paths()) == PATHS
    torchneuron.clear_op_tracking()
    assert set(torchneuron.get_execution_paths().values()) == {0}
    with pytest.raises(ValueError, match="no execution path is named 'warp'"):
        torchneuron._C._count_path("warp")


def test_small_ops_on_an_idle_stream_run_at_the_call():
    x = torch.randn(64)
    d = x.to("neuron")
    mask = d > 0
    torch.neuron.synchronize()
    got: list[torch.Tensor] = []
    assert taken(lambda: got.append(d + d)) == {"fast": 1}
    assert taken(lambda: got.append(d.view(8, 8))) == {"now": 1}
    assert taken(lambda: got.append(torch.nonzero(mask))) == {"host": 1}  # its result's shape depends on data
    torch.testing.assert_close(got[0].cpu(), x + x, rtol=0, atol=0)
    assert torch.equal(got[1].cpu(), x.view(8, 8)) and torch.equal(got[2].cpu(), torch.nonzero(x > 0))


def test_a_signature_is_learnt_at_its_first_call_then_queued_in_one_of_three_forms():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(7, 33, generator=g), torch.randn(33, generator=g), torch.randn(33, generator=g)
    xs = [torch.rand(5, 3, generator=g) + 0.1 for _ in range(3)]
    d, dw, db, dxs = x.to("neuron"), w.to("neuron"), b.to("neuron"), [t.to("neuron") for t in xs]
    torch.neuron.synchronize()
    cases = [(lambda a: torch.cumsum(a[0], 1), lambda: (d,), lambda: (x,), "queued_out"),
             (lambda a: torch._foreach_sqrt(a[0]), lambda: (dxs,), lambda: (xs,), "queued_each"),
             (lambda a: torch.native_layer_norm(a[0], [33], a[1], a[2], 1e-5), lambda: (d, dw, db), lambda: (x, w, b),
              "queued_copy")]
    for op, dev_args, cpu_args, queued in cases:
        outs: list = []

        def call(op=op, dev_args=dev_args, outs=outs) -> None:
            outs.append(op(dev_args()))

        assert taken(call) == {"first_call": 1}, queued
        with Gate() as gate:  # the stream is busy: a known signature is queued, whatever its size
            assert taken(call) == {queued: 1}
            gate.open()
        assert gate.released is not False
        ref = op(cpu_args())
        for out in outs:
            torch.testing.assert_close(torch.utils._pytree.tree_map(lambda t: t.cpu(), out), ref, rtol=0, atol=0)


def test_an_explicit_kernel_and_a_compiled_graph_have_paths_of_their_own():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    got = taken(lambda: torch.nn.functional.scaled_dot_product_attention(*(t.to("neuron") for t in (q, k, v))))
    assert got.get("kernel", 0) >= 1 and set(got) <= {"kernel", "fast", "now", "host", "first_call"}, got
    f = torch.compile(lambda a: (a.sin() * 2).sum(0), backend="neuron")
    a = torch.randn(16, 16)
    f(a.to("neuron"))
    got = []
    assert taken(lambda: got.append(f(a.to("neuron")))).get("compiled") == 1
    torch.testing.assert_close(got[0].cpu(), (a.sin() * 2).sum(0))
