"""In a child forked after the parent used the device, torch.compile of a plain CPU function fails with
"Cannot re-initialize neuron in forked subprocess" (InternalTorchDynamoError). Expected (issue 26: the child can do
any CPU work; CUDA's children compile CPU functions fine): the compiled CPU function runs."""
import os
import traceback

import torch

torch.ones(4, device="neuron").sum().item()  # the parent uses the device
pid = os.fork()
if pid == 0:
    try:
        out = torch.compile(lambda t: t * 2 + 1, backend="inductor")(torch.ones(3))
        print("OK: child compiled CPU function ->", out.tolist(), flush=True)
        code = 0
    except Exception:  # noqa: BLE001
        print("BUG: child torch.compile on CPU failed:\n" + traceback.format_exc()[-1500:], flush=True)
        code = 1
    os._exit(code)
_, st = os.waitpid(pid, 0)
print("child status", os.waitstatus_to_exitcode(st))
