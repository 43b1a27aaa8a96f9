"""Two independent failures on one stream: successive sync points raise each once, oldest first; an exception inside
`with torch.neuron.stream(s):` restores the current stream."""
import torch
from _pc import DEV, check, done, drain, failing, slow

a = failing()
src = torch.randn(16, 4, device=DEV)
for _ in range(2):
    torch.gather(src, 0, torch.tensor([[0] * 4] * 2, device=DEV)) + 1
slow()  # the stream is busy again: b queues
b = torch.gather(src, 0, torch.tensor([[99] * 4] * 2, device=DEV))
seen = []
for _ in range(3):
    try:
        torch.neuron.synchronize()
        seen.append(None)
    except Exception as e:  # noqa: BLE001
        seen.append(type(e).__name__)
check(seen == ["IndexError", "RuntimeError", None], f"successive syncs raise both, oldest first: {seen}")
drain()
s = torch.neuron.Stream()
before = torch.neuron.current_stream()
try:
    with torch.neuron.stream(s):
        slow()
        raise ValueError("user")
except ValueError:
    pass
check(torch.neuron.current_stream() == before, "current stream restored after an exception in the stream context")
done()
