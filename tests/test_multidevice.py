"""Several logical cores in one process: device guard, cross-device copies, and clear errors."""
import pytest
import torch
import torch.nn as nn


def test_ops_stay_on_their_device():
    a = torch.randn(4, 4, device="neuron:3")
    b = (a @ a).relu() + 1
    assert b.device == torch.device("neuron:3")
    assert torch.neuron.current_device() == 0  # the guard restored the current device


def test_copies_between_devices_and_host():
    a = torch.arange(6.0).reshape(2, 3)
    d1 = a.to("neuron:1")
    d2 = d1.to("neuron:2")
    assert d2.device.index == 2 and torch.equal(d2.cpu(), a)
    d2.t().contiguous()  # non-contiguous source
    d3 = torch.empty(3, 2, device="neuron:3").copy_(d1.t())
    assert torch.equal(d3.cpu(), a.t())
    h = torch.empty(3, 2).copy_(d3)
    assert torch.equal(h, a.t())


def test_a_queued_copy_between_devices_reads_the_source_as_it_was_at_the_copy():
    """A copy from neuron:1 launched on neuron:0 while neuron:0 is busy runs later, on neuron:0's stream: neuron:1's
    stream waits for it (as CUDA's copy runs on the source's stream), so neither a write launched on neuron:1 after
    it nor the source freed and its memory reused there reaches what it reads (nn.DataParallel's replicas'
    gradients did: silent garbage)."""
    busy = torch.randn(768, 768, device="neuron:0")
    for reuse in (True, False):
        with torch.accelerator.device_index(1):
            t = torch.full((4096,), 7.0, device="neuron:1")
            torch.neuron.synchronize(1)
        for _ in range(6):
            busy = (busy @ busy).tanh()  # neuron:0 busy: the copy waits in its queue
        u = t.to("neuron:0")
        with torch.accelerator.device_index(1):
            if reuse:
                del t
                torch.full((4096,), -1.0, device="neuron:1")  # t's memory, on neuron:1's stream
            else:
                t.fill_(-1.0)
        assert u.cpu().eq(7.0).all(), reuse


def test_data_parallel_steps_without_a_host_sync_match_the_cpu():
    """pytorch/examples' imagenet under DataParallel (its default on 4 cores): steps launched back to back, the host
    never waiting, then evaluation. The replicas' gradients reach the first core by copies queued behind its work;
    the result equals the CPU running the chunks one by one."""
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(),  # noqa: E731
                                 nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, 10))
    net, ref = make(), make()
    ref.load_state_dict(net.state_dict())
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    model = nn.DataParallel(net.to("neuron"))
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    n = torch.neuron.device_count()
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x.to("neuron")), y.to("neuron"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        chunks = x.chunk(n)
        outs = [ref(chunks[0])]  # BatchNorm: each replica's own statistics; the running ones are the first's
        buffers = {k: b.clone() for k, b in ref.named_buffers()}
        outs += [ref(c) for c in chunks[1:]]
        ropt.zero_grad()
        nn.functional.cross_entropy(torch.cat(outs), y).backward()
        for k, b in ref.named_buffers():
            b.copy_(buffers[k])
        ropt.step()
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.allclose(model(x.to("neuron")).cpu(), ref(x), atol=1e-4)
    for p, r in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.detach().cpu(), r.detach(), atol=1e-4)


def test_device_context_manager():
    with torch.neuron.device(2):
        assert torch.randn(2, device="neuron").device.index == 2
    assert torch.neuron.current_device() == 0
    t = torch.ones(1, device="neuron:1")
    with torch.neuron.device_of(t):
        assert torch.neuron.current_device() == 1


def test_two_devices_in_one_op_is_an_error():
    a, b = torch.ones(3, device="neuron:0"), torch.ones(3, device="neuron:1")
    with pytest.raises(RuntimeError, match="same device.*neuron:0 and neuron:1"):
        a + b
    with pytest.raises(RuntimeError, match="same device"):
        torch.cat([a, b])
    assert (a + a).sum().item() == 6


def test_host_tensor_in_device_op_is_an_error_but_scalars_are_fine():
    a = torch.ones(3, device="neuron")
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(3)
    assert (a * torch.tensor(2.0)).sum().item() == 6  # 0-dim host tensors act as scalars, like CUDA
    assert a[torch.tensor([0, 2])].shape == (2,)  # host indices are accepted, like CUDA


def test_invalid_indices():
    with pytest.raises(torch.AcceleratorError, match="valid indices are 0..3"):
        torch.empty(1, device="neuron:4")
    with pytest.raises(torch.AcceleratorError):
        torch.neuron.set_device(7)
    with pytest.raises(AssertionError, match="Invalid device id"):  # as torch.cuda.get_device_properties
        torch.neuron.get_device_properties(5)
    assert torch.neuron.current_device() == 0


def test_model_on_second_device_trains():
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).to("neuron:1")
    opt = torch.optim.Adam(m.parameters())
    for _ in range(2):
        loss = m(torch.randn(5, 4, device="neuron:1")).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.grad.device.index == 1 for p in m.parameters())


@pytest.mark.parametrize("device_ids", [None, [0], [1, 3]])
def test_data_parallel_matches_the_cpu(device_ids):
    """nn.DataParallel scatters the batch over the cores, runs a replica on each (BatchNorm sees its own chunk)
    and gathers on the first: two SGD steps equal the CPU running the chunks one by one. PyTorch's comm functions
    are CUDA-only C++, so this raised AttributeError (torch._C._scatter) before, on one core too."""
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))  # noqa: E731
    net, ref = make(), make()
    ref.load_state_dict(net.state_dict())
    ids = device_ids or list(range(torch.neuron.device_count()))
    model = nn.DataParallel(net.to(f"neuron:{ids[0]}"), device_ids=device_ids)
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(6, 5)  # on 4 cores chunk() gives 3 pieces: DataParallel then uses 3 replicas, as on CUDA
    for inputs in (x, x.to(f"neuron:{ids[-1]}")):  # a host batch, then one on another core
        out = model(inputs)
        assert out.device == torch.device("neuron", ids[0])
        opt.zero_grad()
        out.pow(2).mean().backward()
        opt.step()
        expected = torch.cat([ref(c) for c in x.chunk(len(ids))])  # BatchNorm: each replica's own statistics
        ropt.zero_grad()
        expected.pow(2).mean().backward()
        ropt.step()
        assert torch.allclose(out.detach().cpu(), expected.detach(), atol=1e-5)
    for p, r in zip(net.parameters(), ref.parameters(), strict=True):
        assert p.device.index == ids[0] and torch.allclose(p.detach().cpu(), r.detach(), atol=1e-5)
