"""TORCHNEURON_LAUNCH_BLOCKING=1: each failing op raises at its own line with the CPU's type; nothing is left
pending; streams/events/sync quiet afterwards. Run: TORCHNEURON_LAUNCH_BLOCKING=1 python p18_launch_blocking.py"""
import os

import torch
import torch.nn.functional as F
from _pc import DEV, done, no_raise, raises, slow

assert os.environ.get("TORCHNEURON_LAUNCH_BLOCKING") == "1"
src = torch.randn(8, 4, device=DEV)
for _ in range(2):
    torch.index_select(src, 0, torch.tensor([0, 1], device=DEV))
side = torch.neuron.Stream()
cases = [
    ("index_select", IndexError, lambda: torch.index_select(src, 0, torch.tensor([0, 99], device=DEV))),
    ("embedding", IndexError, lambda: F.embedding(torch.tensor([99], device=DEV), src)),
    ("gather", RuntimeError, lambda: torch.gather(src, 0, torch.full((2, 4), 99, device=DEV))),
    ("scatter_", RuntimeError, lambda: src.clone().scatter_(0, torch.full((2, 4), 99, device=DEV), 1.0)),
    ("index_add_", RuntimeError, lambda: src.clone().index_add_(0, torch.tensor([99], device=DEV), torch.ones(1, 4, device=DEV))),
    ("advanced index", IndexError, lambda: src[torch.tensor([99], device=DEV)]),
    ("nll_loss", IndexError, lambda: F.nll_loss(src.log_softmax(1), torch.tensor([9] * 8, device=DEV))),
    ("int div zero", RuntimeError, lambda: torch.ones(4, dtype=torch.int32, device=DEV) // torch.zeros(4, dtype=torch.int32, device=DEV)),
    ("multinomial neg", RuntimeError, lambda: torch.multinomial(torch.tensor([-1.0, 2.0], device=DEV), 1)),
]
for name, exc, fn in cases:
    for stream in (None, side):
        with torch.neuron.stream(stream) if stream is not None else torch.neuron.stream(torch.neuron.current_stream()):
            slow(2)
            raises(fn, exc, what=f"{name} ({'side' if stream else 'default'} stream) raises at the call")
        no_raise(lambda: torch.neuron.synchronize(), f"{name}: nothing pending after")
done()
