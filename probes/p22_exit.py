"""Exit: pending error on a side stream; an uncaught exception plus a pending error; a pending error whose tensor
was freed; a failure already seen (exit 0); pending error in a finished non-daemon thread; sys.exit(3) with a
pending error; many pending failures. Each script runs in its own interpreter with a 60 s timeout."""
import subprocess
import sys

from _pc import check, done

PRE = "import sys; sys.path.insert(0, %r)\nimport torch\nfrom _pc import failing, slow, DEV\n" % sys.path[0]
CASES = {
    "side stream pending": ("s = torch.neuron.Stream()\nwith torch.neuron.stream(s):\n    bad = failing()\n", 1, "index_select"),
    "uncaught exception + pending": ("bad = failing()\nraise ValueError('user error')\n", 1, "ValueError"),
    "pending, tensor freed": ("bad = failing()\ndel bad\n", 1, "index_select"),
    "pending, temporary result": ("failing()\n", 1, "index_select"),
    "seen already": ("bad = failing()\ntry:\n    torch.neuron.synchronize()\nexcept IndexError:\n    pass\n", 0, None),
    "seen by poisoned read only": ("bad = failing()\ntry:\n    bad.cpu()\nexcept IndexError:\n    pass\n", 0, None),
    "thread pending": ("import threading\ndef f():\n    global bad\n    bad = failing()\nt = threading.Thread(target=f); t.start(); t.join()\n", 1, "index_select"),
    "sys.exit(3) + pending": ("bad = failing()\nsys.exit(3)\n", None, "index_select"),
    "two streams pending": ("s = torch.neuron.Stream()\nwith torch.neuron.stream(s):\n    b1 = failing()\nb2 = failing()\n", 1, "index_select"),
    "pending + daemon launching": ("import threading, time\nbad = failing()\ndef f():\n    x = torch.ones(512, 512, device=DEV)\n    while True:\n        x = (x @ x).tanh()\nthreading.Thread(target=f, daemon=True).start()\ntime.sleep(0.3)\n", 1, "index_select"),
    "KeyboardInterrupt + pending": ("bad = failing()\nraise KeyboardInterrupt\n", None, "index_select"),
    "pending + atexit handler syncs": ("import atexit\nbad = failing()\ndef h():\n    try:\n        torch.neuron.synchronize()\n    except IndexError:\n        print('handler caught', file=sys.stderr)\natexit.register(h)\n", 0, "handler caught"),
}
for name, (body, want_rc, want_err) in CASES.items():
    code = PRE + body
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        check(False, f"{name}: HANG (60 s)")
        continue
    err = p.stderr
    n_reports = err.count("still pending at exit")
    ok_rc = p.returncode != 0 if want_rc is None else p.returncode == want_rc
    check(ok_rc, f"{name}: exit status {p.returncode} (want {'non-zero' if want_rc is None else want_rc})")
    if want_err:
        check(want_err in err, f"{name}: stderr mentions {want_err!r}")
    else:
        check("pending" not in err, f"{name}: no pending report on stderr")
    if name == "two streams pending":
        check(err.count("IndexError") >= 2, f"{name}: both failures printed ({err.count('IndexError')} IndexError mentions)")
    if name.startswith("pending + atexit"):
        check(n_reports == 0, f"{name}: error caught by a user atexit handler is not printed again ({n_reports})")
    if p.returncode not in (0, 1) or "terminate called" in err or "Segmentation" in err:
        print("   stderr tail:", err[-400:])
done()
