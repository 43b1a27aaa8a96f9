"""Differential fuzzing of the asynchronous device against the CPU (issue 26): tests/fuzz_programs.py makes seeded
random programs, runs them on the CPU and on `neuron` and checks the rules of its docstring (error types and
positions, deferred device-side errors, never a garbage value).

CI runs a fixed sample: TORCHNEURON_FUZZ_PROGRAMS programs in all (default 150), split over the modes (default,
queue-everything, launch blocking), each mode its own seeds. A release check sets e.g.
TORCHNEURON_FUZZ_PROGRAMS=5000 (and TORCHNEURON_FUZZ_SEED to move the seed range). On a mismatch the test prints
the seed, the program minimized to the statements that still show it, as runnable Python, and both traces.

A finding still open in the runtime (fuzz_programs.FINDINGS) is not a sample failure:
a program whose first mismatch is of an open finding's class is counted and named, and the finding's own test
below (its minimal repro, xfail strict) fails until the runtime fixes it, then passes and flips, so the finding is
closed by removing it from FINDINGS (which makes the sample strict for it again).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests import fuzz_programs as fp

PROGRAMS = int(os.environ.get("TORCHNEURON_FUZZ_PROGRAMS", "150"))
SEED = int(os.environ.get("TORCHNEURON_FUZZ_SEED", "0"))


@pytest.fixture(autouse=True)
def _drained():
    """Each test starts drained and leaves the device drained, in the mode it found (a CI leg's mode: the tests after
    this file run in it too)."""
    fp.drain()
    mode = fp.mode_now()
    yield
    torch.neuron.set_stream(torch.neuron.default_stream())
    fp.set_mode(mode)
    fp.drain()


@pytest.mark.parametrize("mode", fp.MODES)
def test_fuzz_sample(mode):
    n = PROGRAMS // len(fp.MODES)
    unknown, known = fp.sample(mode, n, SEED)
    if known:
        print(f"{mode}: programs with an open finding first:",
              "; ".join(f"{k}: {len(v)} (seeds {v[:5]})" for k, v in sorted(known.items())))
    if unknown:
        out = fp.minimize(unknown[0], budget_s=60)
        pytest.fail(f"{len(unknown)} of {n} programs in mode {mode!r} broke a rule with no open finding (seeds "
                    f"{[o.prog.seed for o in unknown][:20]}).\nThe first, minimized:\n{fp.repro(out)}\n"
                    f"Traces:\n{fp.traces(out)}")


@pytest.mark.parametrize("finding", [pytest.param(f, id=f.id, marks=pytest.mark.xfail(
    strict=True, reason=f"open finding {f.id}: {f.title}")) for f in fp.FINDINGS])
def test_open_finding_is_fixed(finding):
    """Each open finding's minimal program; xfail (strict) until the runtime fixes it."""
    out = fp.check(finding.program(), finding.mode)
    assert not out.mismatches, f"{finding.id}: {finding.title}\n{fp.traces(out)}\n" + "\n".join(
        f"rule {m.rule} at {m.index} ({m.kind}): {m.what}" for m in out.mismatches)


def test_the_comparator_catches_what_it_must():
    """The rules bite: a garbage value, an error at the wrong statement, a deferred error that never surfaces and a
    wrong exception type each make a mismatch (synthetic traces against one program)."""
    prog = fp.Program(0, [fp.Stmt("t0 = mk((4,), torch.int64, 1, 'int')", "create", binds=("t0",)),
                          fp.Stmt("t1 = t0.index_select(0, torch.tensor([9], device=dev))", "index_op",
                                  reads=("t0",), binds=("t1",), deferrable=True),
                          fp.Stmt("t0.add_(1)", "inplace", reads=("t0",), writes=("t0",)),
                          fp.Stmt("dm.synchronize()", "sync", sync=True),
                          fp.Stmt("rec('t0', t0)", "final_read", reads=("t0",), sync=True)])
    cpu = fp.run(prog, "cpu")
    assert cpu[1].exc == "IndexError" and cpu[4].records
    good = fp.run(prog, "cpu")
    assert not fp.compare(prog, cpu, good, "default")
    # deferred to the sync: allowed, except under launch blocking
    deferred = [fp.Result(), fp.Result(), fp.Result(), fp.Result("IndexError"), good[4]]
    assert not fp.compare(prog, cpu, deferred, "default")
    assert [m.rule for m in fp.compare(prog, cpu, deferred, "blocking")] == [4, 4]
    # raised by an unrelated launch that is no sync point: rule 2
    early = [fp.Result(), fp.Result(), fp.Result("IndexError"), fp.Result(), good[4]]
    assert [m.rule for m in fp.compare(prog, cpu, early, "default")] == [2]
    # never surfaced
    lost = [fp.Result(), fp.Result(), fp.Result(), fp.Result(), good[4]]
    assert [m.rule for m in fp.compare(prog, cpu, lost, "default")] == [2]
    # wrong type at the statement
    wrong = [fp.Result(), fp.Result("RuntimeError"), fp.Result(), fp.Result(), good[4]]
    assert [m.rule for m in fp.compare(prog, cpu, wrong, "default")] == [1]
    # a garbage value
    garbage = fp.Result(records=[("t0", cpu[4].records[0][1] + 7)])
    assert [m.rule for m in fp.compare(prog, cpu, [*good[:4], garbage], "default")] == [3]
