"""fork: a child that exits normally (atexit handlers run) while the parent had a pending error and queued work;
device APIs in the child; the parent's pending error after the fork."""
import os
import sys
import time

import torch
from _pc import DEV, check, done, failing

x = torch.ones(1024, 1024, device=DEV)
bad = failing()  # pending in the parent
y = x * 2
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    msgs = []
    a = torch.randn(256, 256)
    msgs.append(f"cpu_ok={bool(torch.allclose(a @ a, (a @ a).clone()))}")
    for name, fn in [("tensor", lambda: torch.ones(2, device=DEV)), ("op on inherited", lambda: y + 1),
                     ("read inherited", lambda: y.cpu()), ("item", lambda: y[0, 0].item()),
                     ("print", lambda: repr(y)), ("sync", lambda: torch.neuron.synchronize()),
                     ("stream", lambda: torch.neuron.Stream()), ("event", lambda: torch.neuron.Event().record()),
                     ("mem", lambda: torch.neuron.memory_allocated()), ("to", lambda: torch.ones(2).to(DEV)),
                     ("poisoned read", lambda: bad.cpu()),
                     ("compile cpu", lambda: torch.compile(lambda t: t * 2 + 1, backend="inductor")(torch.ones(3)))]:
        try:
            fn()
            msgs.append(f"{name}=noerr")
        except Exception as ex:  # noqa: BLE001
            msgs.append(f"{name}={type(ex).__name__}:{'neuron' in str(ex)}:{str(ex)[:60]!r}")
    os.write(w, ("\n".join(msgs)).encode())
    os.close(w)
    sys.exit(0)  # a normal exit: atexit handlers (the device's exit drain) run in the child
os.close(w)
deadline = time.time() + 30
status = None
while time.time() < deadline:
    p, st = os.waitpid(pid, os.WNOHANG)
    if p:
        status = os.waitstatus_to_exitcode(st)
        break
    time.sleep(0.05)
if status is None:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
out = os.read(r, 65536).decode()
print(out)
check(status == 0, f"child exited normally with status 0 (got {status}; None = hung, killed)")
for line in out.splitlines():
    k, _, v = line.partition("=")
    if k == "cpu_ok":
        check(v == "True", "child CPU matmul")
    elif k == "compile cpu":
        check(v == "noerr", f"child torch.compile on CPU: {v}")
    elif k == "mem":
        check(True, f"child memory_allocated: {v}")
    else:
        check(v.startswith("RuntimeError:True"), f"child {k}: {v}")
try:
    torch.neuron.synchronize(); perr = None
except Exception as ex:  # noqa: BLE001
    perr = type(ex).__name__
check(perr == "IndexError", f"parent's pending error raised after the fork ({perr})")
check(torch.equal(y.cpu(), torch.full((1024, 1024), 2.0)), "parent's queued work right")
done()
