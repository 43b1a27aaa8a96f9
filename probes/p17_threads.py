"""Two Python threads, each with its own stream: one launches a failing kernel; the other's results and syncs are
unaffected; the failing thread's stream sync raises it once; nothing hangs."""
import threading

import torch
from _pc import DEV, check, done, drain, failing, setup

setup()
out = {}
barrier = threading.Barrier(2)


def worker(name, fail):
    s = torch.neuron.Stream()
    try:
        with torch.neuron.stream(s):
            barrier.wait()
            x = torch.full((1024, 1024), 2.0, device=DEV)
            acc = []
            for i in range(20):
                if fail and i == 10:
                    bad = failing()
                y = x * i
                acc.append(y.sum())
            try:
                s.synchronize(); out[name + "_sync"] = None
            except Exception as ex:  # noqa: BLE001
                out[name + "_sync"] = type(ex).__name__
            try:
                s.synchronize(); out[name + "_sync2"] = None
            except Exception as ex:  # noqa: BLE001
                out[name + "_sync2"] = type(ex).__name__
            out[name + "_vals"] = [a.item() for a in acc]
    except Exception as ex:  # noqa: BLE001
        out[name + "_exc"] = f"{type(ex).__name__}: {str(ex)[:200]}"


for rnd in range(3):
    out.clear()
    ts = [threading.Thread(target=worker, args=("A", True)), threading.Thread(target=worker, args=("B", False))]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    check(not any(t.is_alive() for t in ts), f"round {rnd}: threads finished")
    want = [2.0 * i * 1024 * 1024 for i in range(20)]
    check(out.get("A_sync") == "IndexError" and out.get("A_sync2") is None, f"round {rnd}: A's stream sync raised once ({out.get('A_sync')}, {out.get('A_sync2')})")
    check(out.get("B_sync") is None and out.get("B_sync2") is None, f"round {rnd}: B's syncs quiet ({out.get('B_sync')})")
    check(out.get("A_vals") == want, f"round {rnd}: A's independent values right {out.get('A_exc', '')}")
    check(out.get("B_vals") == want, f"round {rnd}: B's values right {out.get('B_exc', '')}")
    drain()
done()
