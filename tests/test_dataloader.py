"""Pinned host memory and DataLoader(pin_memory=True) feeding the device."""
import torch
from torch.utils.data import DataLoader, TensorDataset


def test_pin_memory():
    t = torch.randn(16)
    assert not t.is_pinned()
    p = t.pin_memory()
    assert p.is_pinned() and torch.equal(p, t) and p.device.type == "cpu"
    d = p.to("neuron", non_blocking=True)
    assert torch.equal(d.cpu(), t)


def test_pinned_empty():
    e = torch.empty(8, pin_memory=True)
    assert e.is_pinned()


def test_dataloader_pinning_and_training():
    ds = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    loader = DataLoader(ds, batch_size=16, pin_memory=True, num_workers=0)
    m = torch.nn.Linear(4, 2).neuron()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for x, y in loader:
        assert x.is_pinned() and y.is_pinned()
        loss = torch.nn.functional.cross_entropy(m(x.to("neuron", non_blocking=True)), y.to("neuron"))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert m.weight.grad.is_neuron


def test_dataloader_with_workers():
    ds = TensorDataset(torch.arange(32.0).view(16, 2))
    batches = list(DataLoader(ds, batch_size=4, pin_memory=True, num_workers=2))
    assert all(b[0].is_pinned() for b in batches)
    assert torch.equal(torch.cat([b[0] for b in batches]), ds.tensors[0])
