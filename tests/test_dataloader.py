"""Pinned host memory and DataLoader(pin_memory=True) feeding the device."""
import pytest
import torch
from helpers import clean_env
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


def test_worker_returning_a_neuron_tensor_raises_in_the_main_process(tmp_path):
    """On CUDA the error of a worker that makes device tensors reaches the main process; a neuron batch cannot
    be shared between processes, and the queue's feeder thread used to drop it (the main process then waited
    forever). The main process must raise a clear error in bounded time, with fork and with spawn."""
    code = """
        import sys, torch
        from torch.utils.data import DataLoader, Dataset

        class OnNeuron(Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return torch.full((2,), float(i), device="neuron")

        if __name__ == "__main__":
            for ctx in ("fork", "spawn"):
                try:
                    next(iter(DataLoader(OnNeuron(), batch_size=2, num_workers=1, multiprocessing_context=ctx,
                                         timeout=120)))
                    print(ctx, "no error")
                except RuntimeError as e:
                    print(ctx, "cannot be shared between processes" in str(e), "shape (2, 2)" in str(e))
            # CPU batches from workers still work, and neuron tensors in the main process too
            dl = DataLoader(torch.arange(8.0), batch_size=4, num_workers=1)
            print(torch.cat([b.to("neuron") for b in dl]).sum().item())
    """
    import subprocess
    import sys
    import textwrap

    (tmp_path / "loader.py").write_text(textwrap.dedent(code))  # a file: spawned workers re-import it
    env = clean_env()
    p = subprocess.run([sys.executable, str(tmp_path / "loader.py")], capture_output=True, text=True, env=env,
                       timeout=240)
    assert p.stdout.split() == ["fork", "True", "True", "spawn", "True", "True", "28.0"], p.stdout + p.stderr[-2000:]


def test_multiprocessing_queue_with_a_neuron_tensor_raises_in_the_receiver():
    import torch.multiprocessing as mp

    q = mp.get_context("spawn").SimpleQueue()
    q.put(torch.ones(2, device="neuron"))
    q.put(torch.ones(2, device="neuron").untyped_storage())
    q.put(torch.ones(2))
    for what in ("tensor of shape (2,)", "storage"):
        with pytest.raises(RuntimeError, match=f"neuron {what.replace('(', '.').replace(')', '.')} was sent"):
            q.get()
    assert torch.equal(q.get(), torch.ones(2))
