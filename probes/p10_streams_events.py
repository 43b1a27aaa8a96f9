"""Events (timing), synchronize twice, failures on two streams, wait_event chains, Stream.synchronize scope."""
import torch
from _pc import DEV, check, done, drain, failing, no_raise, raises, slow

E = IndexError
# 1. timing events around a failure
s, e = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
s.record()
bad = failing()
e.record()
raises(lambda: e.synchronize(), E, what="Event.synchronize after a failure raises it")
no_raise(lambda: e.synchronize(), "second Event.synchronize is quiet")
ms = no_raise(lambda: s.elapsed_time(e), "elapsed_time after the failure")
check(ms is not None and ms > 50, f"elapsed_time covers the slow work ({ms})")
check(e.query(), "event query True after")
no_raise(lambda: torch.neuron.synchronize(), "synchronize after (raised once)")
no_raise(lambda: torch.neuron.synchronize(), "synchronize again")
# 2. two streams both fail, sync raises one, then the other, then nothing
a, b = torch.neuron.Stream(), torch.neuron.Stream()
with torch.neuron.stream(a):
    ba = failing()
with torch.neuron.stream(b):
    bb = failing(torch.randn(16, 4, device=DEV))
errs = []
for _ in range(3):
    try:
        torch.neuron.synchronize(); errs.append(None)
    except Exception as ex:  # noqa: BLE001
        errs.append(type(ex).__name__)
print("two-stream sync sequence:", errs)
check(errs == ["IndexError", "IndexError", None], f"both failures raised once each by successive synchronizes: {errs}")
raises(lambda: bb.cpu(), E, what="b's result poisoned")
# 3. stream b synchronize does not raise stream a's failure
drain()
with torch.neuron.stream(a):
    ba = failing()
with torch.neuron.stream(b):
    y = torch.ones(1024, 1024, device=DEV) * 2
no_raise(lambda: b.synchronize(), "b.synchronize does not raise a's failure")
check(torch.equal(y.cpu(), torch.full((1024, 1024), 2.0)), "b's result")
raises(lambda: a.synchronize(), E, what="a.synchronize raises a's failure")
no_raise(lambda: torch.neuron.synchronize(), "device sync quiet after")
# 4. event chain: a fails, ev on a, b waits ev, c waits b (wait_stream): c's sync raises it
c = torch.neuron.Stream()
with torch.neuron.stream(a):
    ba = failing()
    ev = torch.neuron.Event()
    ev.record()
b.wait_event(ev)
with torch.neuron.stream(b):
    tb = ba * 2 if False else torch.ones(3, device=DEV)
c.wait_stream(b)
raises(lambda: c.synchronize(), E, what="transitive: c waited b waited a's event")
no_raise(lambda: torch.neuron.synchronize(), "then everything quiet (raised once)")
# 5. event recorded before the failure: its synchronize must not raise (work before it succeeded)
with torch.neuron.stream(a):
    slow()
    ev0 = torch.neuron.Event(); ev0.record()
    ba = failing(busy=False) if False else None
    src = torch.randn(8, 4, device=DEV)
    bad = torch.index_select(src, 0, torch.tensor([0, 99], device=DEV))
no_raise(lambda: ev0.synchronize(), "event recorded before the failing kernel: synchronize quiet")
raises(lambda: a.synchronize(), E, what="a.synchronize then raises")
drain()
done()
