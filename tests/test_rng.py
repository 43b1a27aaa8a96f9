"""RNG: per-device counter-based (Philox4x32-10) generators with CUDA's [seed, offset] state, seeding, state
save/restore, and numbers checked against an independent Python implementation of Philox."""
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from helpers import clean_env

M32 = 0xFFFFFFFF


def philox(key: tuple[int, int], ctr: tuple[int, int, int, int]) -> list[int]:
    """Philox4x32-10 (Salmon et al., SC'11), written from the paper's round function."""
    c, (k0, k1) = list(ctr), key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & M32, (p0 >> 32) ^ c[3] ^ k1, p0 & M32]
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c


def reference_uniform(seed: int, offset: int, n: int) -> torch.Tensor:
    """What element i of a neuron random op draws: counter offset + i, 53 bits of words 0-1, in (0, 1)."""
    out = []
    for i in range(n):
        w = philox((seed & M32, seed >> 32), ((offset + i) & M32, (offset + i) >> 32, 0, 0))
        out.append((((w[1] << 32 | w[0]) >> 11) + 0.5) / 2.0**53)
    return torch.tensor(out, dtype=torch.float64)


def reference_mask_uniform(seed: int, offset: int, n: int) -> torch.Tensor:
    """What element i of a Bernoulli mask (dropout's) draws: position g = offset + i reads word (g >> 4) & 3 of counter
    (g >> 6) * 16 + (g & 15) with the counter's third word 1 (the masks' own stream), as w / 2^32: kept below p."""
    out = []
    for i in range(n):
        g = offset + i
        c = (g >> 6) * 16 + (g & 15)
        out.append(philox((seed & M32, seed >> 32), (c & M32, c >> 32, 1, 0))[(g >> 4) & 3] / 2.0**32)
    return torch.tensor(out, dtype=torch.float64)


def state_of(gen_state: torch.Tensor) -> tuple[int, int]:
    return gen_state[:8].view(torch.int64).item(), gen_state[8:].view(torch.int64).item()


def test_reference_philox_matches_random123_known_answers():
    assert philox((0, 0), (0, 0, 0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox((M32, M32), (M32,) * 4) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert philox((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)) == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_rand_is_philox_of_seed_and_position():
    torch.manual_seed(7)
    assert torch.equal(torch.rand(10, device="neuron", dtype=torch.float64).cpu(), reference_uniform(7, 0, 10))
    # the next op starts at the next multiple of 4 (CUDA's offset rule, which DTensor's increments follow)
    assert torch.equal(torch.rand(3, device="neuron").cpu(), reference_uniform(7, 12, 3).float())


def test_vectorised_draws_match_the_reference_across_a_carry_and_ragged_ends():
    """The kernels make eight (AVX2) or sixteen (AVX-512) counters at a time: a run that starts unaligned, crosses
    the low counter word's wrap (2^32) and ends mid-vector draws exactly the reference values."""
    seed, offset = 0x1234_5678_9ABC_DEF0, 2**32 - 20
    torch.neuron.set_rng_state(torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8))
    got = torch.empty(45, device="neuron", dtype=torch.float64).uniform_().cpu()
    assert torch.equal(got, reference_uniform(seed, offset, 45))


@pytest.mark.parametrize("offset", [2**34 - 100, 12], ids=["counter-wrap", "small"])
def test_bernoulli_masks_match_the_reference_in_every_dtype_and_layout(offset):
    """A mask's elements take one word each, sixteen consecutive elements from one word of sixteen counters: a run that
    starts inside a 64-element block, crosses the mask counters' low-word wrap (position 2^34) and ends inside a block
    keeps exactly the reference's elements, in every float dtype and bool, for p at its ends and just below 1 (every
    word is below it), at one element's own draw and just above it; a strided tensor and an integer one get the same
    mask in logical order."""
    seed = 0x1234_5678_9ABC_DEF0
    ref = reference_mask_uniform(seed, offset, 150)
    below_one, own, above_own = math.nextafter(1.0, 0.0), ref[17].item(), math.nextafter(ref[17].item(), 1.0)
    for p in (0.0, 0.3, 0.9, 1.0, below_one, own, above_own):
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool):
            torch.neuron.set_rng_state(torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8))
            drawn = torch.empty(150, device="neuron", dtype=dtype).bernoulli_(p).cpu()
            assert torch.equal(drawn, (ref < p).to(dtype)), (p, dtype)
    torch.neuron.set_rng_state(torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8))
    strided = torch.zeros(15, 20, device="neuron")[:, ::2].bernoulli_(0.5).cpu()
    assert torch.equal(strided, (ref < 0.5).float().view(15, 10))
    torch.neuron.set_rng_state(torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8))
    assert torch.equal(torch.empty(150, device="neuron", dtype=torch.int32).bernoulli_(0.5).cpu(),
                       (ref < 0.5).int())
    assert state_of(torch.neuron.get_rng_state()) == (seed, offset + 152)  # 150 positions, rounded up to 4


_DRAWS = """
import json, sys, torch, torchneuron
seed, offset = 0x1234_5678_9ABC_DEF0, int(sys.argv[1])
torch.neuron.set_rng_state(torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8))
u = torch.empty(45, device="neuron", dtype=torch.float64).uniform_().cpu()
torch.neuron.set_rng_state(torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8))
m = torch.empty(150, device="neuron").bernoulli_(0.3).cpu()
print(json.dumps([u.tolist(), m.tolist()]))
"""


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_every_vector_form_draws_the_reference(capability):
    """ATEN_CPU_CAPABILITY caps the kernels' vector forms as it caps ATen's: the scalar and AVX2 forms (which an
    AVX-512 machine never runs otherwise) draw the same uniforms and masks as the reference, across both wraps."""
    seed = 0x1234_5678_9ABC_DEF0
    for offset in (2**32 - 20, 2**34 - 100):
        out = subprocess.run([sys.executable, "-c", _DRAWS, str(offset)], capture_output=True, text=True, timeout=120,
                             env=clean_env(ATEN_CPU_CAPABILITY=capability))
        assert out.returncode == 0, out.stderr
        u, m = (torch.tensor(v, dtype=torch.float64) for v in json.loads(out.stdout))
        assert torch.equal(u, reference_uniform(seed, offset, 45))
        assert torch.equal(m, (reference_mask_uniform(seed, offset, 150) < 0.3).double())


def test_masks_and_other_draws_do_not_share_words():
    """A mask reads a stream of counters of its own: its words are never the words an earlier uniform drew, so a
    dropout over the positions a `rand` drew is not that `rand` thresholded (it was, when a mask element took its
    position's counter)."""
    seed = 9
    u = reference_uniform(seed, 0, 64)
    m = reference_mask_uniform(seed, 0, 64)
    words = {int(x * 2**53) >> 21 for x in u}  # rand's high words
    assert not words & {int(x * 2**32) for x in m}
    state = torch.tensor([seed, 0], dtype=torch.int64).view(torch.uint8)
    torch.neuron.set_rng_state(state)
    drawn = torch.rand(4096, device="neuron", dtype=torch.float64).cpu()
    torch.neuron.set_rng_state(state)
    kept = torch.empty(4096, device="neuron", dtype=torch.bool).bernoulli_(0.5).cpu()
    assert 0.45 < (kept == (drawn < 0.5)).double().mean() < 0.55  # independent: agree about half the time


def test_state_is_cudas_seed_offset_layout():
    torch.neuron.manual_seed(11)
    state = torch.neuron.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu" and state.numel() == 16
    assert state_of(state) == (11, 0)
    torch.randn(10, device="neuron")
    assert state_of(torch.neuron.get_rng_state()) == (11, 12)
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch.neuron.set_rng_state(torch.zeros(5056, dtype=torch.uint8))


def test_values_depend_only_on_counter_position():
    """A shard drawn at the offset of its first element equals that slice of the whole tensor (DTensor's rule)."""
    torch.manual_seed(5)
    state = torch.neuron.get_rng_state()
    whole = torch.randn(4, 8, device="neuron")
    shard = state.clone()
    shard[8:] = torch.tensor([16], dtype=torch.int64).view(torch.uint8)
    torch.neuron.set_rng_state(shard)
    assert torch.equal(torch.randn(2, 8, device="neuron").cpu(), whole[2:].cpu())


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
    a = torch.rand(6, device="neuron", generator=g, dtype=torch.float64)
    assert torch.equal(a.cpu(), reference_uniform(42, 0, 6))
    g.manual_seed(42)
    assert torch.equal(torch.rand(6, device="neuron", generator=g, dtype=torch.float64), a)
    assert torch.Generator(device="neuron:2").device.index == 2


def test_cpu_generator_is_rejected_like_cuda():
    g = torch.Generator()
    msg = "Expected a 'neuron' device type for generator but found 'cpu'"
    with pytest.raises(RuntimeError, match=msg):
        torch.randn(3, device="neuron", generator=g)
    with pytest.raises(RuntimeError, match=msg):  # an op without a counter-based kernel (host fallback)
        torch.multinomial(torch.ones(4, device="neuron"), 2, generator=g)


def test_init_and_dropout_follow_the_reference():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8, device="neuron")  # kaiming_uniform_: uniform_(-b, b) with b = 1/sqrt(16)
    b = 1 / 16**0.5
    assert torch.equal(lin.weight.cpu().flatten(), (reference_uniform(0, 0, 128) * (2 * b) - b).float())
    torch.manual_seed(1)
    x = torch.ones(32, 16, device="neuron")
    keep = reference_mask_uniform(1, 0, 512).view(32, 16) < 0.5
    assert torch.equal(nn.functional.dropout(x, 0.5).cpu(), keep.float() * 2)


def test_distributions():
    torch.manual_seed(2)
    n = 200_000
    z = torch.randn(n, device="neuron").cpu()
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    u = torch.empty(n, device="neuron").uniform_(-2, 3).cpu()
    assert u.min() >= -2 and u.max() < 3 and abs(u.mean() - 0.5) < 0.02
    assert abs(torch.empty(n, device="neuron").exponential_(2.0).cpu().mean() - 0.5) < 0.01
    assert abs(torch.bernoulli(torch.full((n,), 0.3, device="neuron")).cpu().mean() - 0.3) < 0.01
    r = torch.randint(3, 10, (n,), device="neuron").cpu()
    assert r.min() == 3 and r.max() == 9 and r.dtype == torch.int64
    assert torch.equal(torch.randperm(50, device="neuron").cpu().sort().values, torch.arange(50))
    m = torch.multinomial(torch.tensor([0.0, 1, 1, 1], device="neuron"), 3).cpu()
    assert sorted(m.tolist()) == [1, 2, 3]
    h = torch.randn(1000, device="neuron", dtype=torch.bfloat16)
    assert h.dtype == torch.bfloat16 and h.isfinite().all()


def test_same_seed_same_draws_every_op():
    def draws():
        torch.manual_seed(9)
        return [torch.randint(0, 10, (5,), device="neuron"), torch.randperm(7, device="neuron"),
                torch.empty(5, device="neuron").exponential_(), torch.multinomial(torch.ones(6, device="neuron"), 3),
                torch.normal(torch.zeros(5, device="neuron"), 1.0), torch.rand(5, device="neuron")]
    for a, b in zip(draws(), draws(), strict=True):
        assert a.is_neuron and torch.equal(a.cpu(), b.cpu())


def test_checkpoint_recomputes_the_same_dropout():
    """torch.utils.checkpoint saves and restores the device state (get_device_states/set_device_states)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = nn.Linear(32, 32, device="neuron")
    x = torch.randn(16, 32, device="neuron", requires_grad=True)

    def block(t):
        return nn.functional.dropout(lin(t), 0.5).relu()

    grads = []
    for use_checkpoint in (False, True):
        torch.manual_seed(1)
        y = checkpoint(block, x, use_reentrant=False) if use_checkpoint else block(x)
        (g,) = torch.autograd.grad(y.square().sum(), x)
        grads.append(g.cpu())
    assert torch.equal(grads[0], grads[1])


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
    assert torch.equal(out, torch.randn(3, device="neuron") + 1)


def test_seeding_does_not_import_dynamo():
    import subprocess
    import sys
    code = ("import sys, torch; torch.manual_seed(0); torch.neuron.get_rng_state(); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("backend", ["aot_eager", "neuron"])
def test_compiled_checkpoint_recomputes_the_same_dropout(backend):
    """Under torch.compile, AOTAutograd saves the neuron state before a recomputed dropout and replays it in the
    backward (run_and_save_rng_state / run_with_rng_state know the neuron device; the neuron compiler runs them on
    the device between kernels): gradients equal eager's."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = nn.Linear(32, 32, device="neuron")

    def f(x):
        return checkpoint(lambda t: nn.functional.dropout(lin(t), 0.5).relu(), x, use_reentrant=False).square().sum()

    grads = []
    for fn in (f, torch.compile(f, backend=backend)):
        x = torch.linspace(-1, 1, 16 * 32, device="neuron").view(16, 32).requires_grad_()
        torch.manual_seed(1)
        fn(x).backward()
        grads.append(x.grad.cpu())
    assert grads[0].abs().sum() > 0
    assert torch.equal(grads[0], grads[1])
