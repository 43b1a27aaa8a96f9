"""Autograd on neuron: backward runs on the calling thread (no device worker hand-off), in any thread."""
import threading

import torch


def _grad_and_thread(device: str) -> tuple[torch.Tensor, int]:
    x = torch.linspace(-1, 1, 8, device=device, requires_grad=True)
    seen = []
    y = (x.sin() * 3).exp()
    y.register_hook(lambda g: seen.append(threading.get_ident()))
    y.sum().backward()
    return x.grad.cpu(), seen[0]


def test_backward_runs_on_the_calling_thread():
    grad, thread = _grad_and_thread("neuron")
    assert thread == threading.get_ident()
    torch.testing.assert_close(grad, _grad_and_thread("cpu")[0], rtol=0, atol=0)


def test_backward_from_another_thread_uses_pytorchs_device_threads():
    """A new thread has PyTorch's default (multithreaded backward): results are the same, run elsewhere."""
    out = {}
    t = threading.Thread(target=lambda: out.update(r=_grad_and_thread("neuron"), me=threading.get_ident()))
    t.start()
    t.join(60)
    grad, thread = out["r"]
    assert thread != out["me"]
    torch.testing.assert_close(grad, _grad_and_thread("cpu")[0], rtol=0, atol=0)
