"""RNG: per-device generators, seeding, state save/restore, and numbers identical to the CPU's."""
import torch
import torch.nn as nn


def test_manual_seed_gives_cpu_identical_streams():
    torch.manual_seed(7)
    dev = torch.randn(1000, device="neuron")
    torch.manual_seed(7)
    cpu = torch.randn(1000)
    assert torch.equal(dev.cpu(), cpu)


def test_device_generator_is_independent_of_cpu_generator():
    torch.manual_seed(3)
    a = torch.rand(5, device="neuron")
    torch.manual_seed(3)
    torch.rand(100)  # draws from the CPU generator only
    b = torch.rand(5, device="neuron")
    assert torch.equal(a, b)


def test_neuron_manual_seed_and_state_roundtrip():
    torch.neuron.manual_seed(11)
    assert torch.neuron.initial_seed() == 11
    state = torch.neuron.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    a = torch.randn(8, device="neuron")
    torch.neuron.set_rng_state(state)
    assert torch.equal(a, torch.randn(8, device="neuron"))


def test_per_device_generators():
    torch.neuron.manual_seed_all(5)
    a0 = torch.rand(4, device="neuron:0")
    a1 = torch.rand(4, device="neuron:1")
    assert torch.equal(a0.cpu(), a1.cpu())  # same seed, separate generators
    states = torch.neuron.get_rng_state_all()
    assert len(states) == torch.neuron.device_count()
    b1 = torch.rand(4, device="neuron:1")
    torch.neuron.set_rng_state_all(states)
    assert torch.equal(torch.rand(4, device="neuron:1"), b1)


def test_explicit_generator_object():
    g = torch.Generator(device="neuron")
    assert g.device == torch.device("neuron:0")
    g.manual_seed(42)
    a = torch.randn(6, device="neuron", generator=g)
    c = torch.Generator().manual_seed(42)
    assert torch.equal(a.cpu(), torch.randn(6, generator=c))
    g.manual_seed(42)
    assert torch.equal(torch.randn(6, device="neuron", generator=g), a)
    assert torch.Generator(device="neuron:2").device.index == 2


def test_dropout_and_init_match_cpu():
    torch.manual_seed(0)
    cpu = nn.Linear(16, 16)
    torch.manual_seed(0)
    dev = nn.Linear(16, 16, device="neuron")
    assert torch.equal(dev.weight.cpu(), cpu.weight)
    x = torch.randn(32, 16)
    torch.manual_seed(1)
    y_cpu = nn.functional.dropout(x, 0.5)
    torch.manual_seed(1)
    y_dev = nn.functional.dropout(x.neuron(), 0.5)
    assert torch.equal(y_dev.cpu(), y_cpu)


def test_random_ops_cover_distributions():
    torch.manual_seed(2)
    draws = [torch.randint(0, 10, (5,), device="neuron"), torch.randperm(7, device="neuron"),
             torch.empty(5, device="neuron").exponential_(), torch.bernoulli(torch.full((5,), 0.3, device="neuron")),
             torch.multinomial(torch.ones(6, device="neuron"), 3)]
    torch.manual_seed(2)
    ref = [torch.randint(0, 10, (5,)), torch.randperm(7), torch.empty(5).exponential_(),
           torch.bernoulli(torch.full((5,), 0.3)), torch.multinomial(torch.ones(6), 3)]
    for d, r in zip(draws, ref):
        assert d.is_neuron and torch.equal(d.cpu(), r)


def test_seed_is_random():
    torch.neuron.seed()
    s1 = torch.neuron.initial_seed()
    torch.neuron.seed()
    assert torch.neuron.initial_seed() != s1


def test_rng_state_calls_inside_compiled_code_run_eagerly():
    """torch.compile graph-breaks on the RNG functions (as Dynamo skips torch.cuda's): saving and restoring the
    state inside a compiled function (PyTorch's freeze_rng_state, under no_dispatch) works and draws as eager."""
    from torch.testing._internal.common_utils import freeze_rng_state

    def f(x):
        with freeze_rng_state():
            torch.manual_seed(42)
            return torch.randn(3, device="neuron") + x

    torch.manual_seed(0)
    before = torch.neuron.get_rng_state()
    out = torch.compile(f, backend="neuron")(torch.ones(3, device="neuron"))
    assert torch.equal(torch.neuron.get_rng_state(), before)  # restored by freeze_rng_state
    torch.manual_seed(42)
    assert torch.equal(out.cpu(), torch.randn(3) + 1)


def test_seeding_does_not_import_dynamo():
    import subprocess
    import sys
    code = ("import sys, torch; torch.manual_seed(0); torch.neuron.get_rng_state(); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr
