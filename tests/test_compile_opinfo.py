"""PyTorch's OpInfo database through `torch.compile(backend="neuron")`, compared with eager CPU (float32 forward).

Samples are made on `neuron`; each op's first SAMPLES samples are compiled and run, and compared with the op on
CPU copies of the same samples. To fit CI time, ops are compiled BATCH at a time in one function (one Dynamo
graph, one host kernel build); a batch that fails is rerun op by op, so every failure is an op's own. Random ops
run alone, seeded like the CPU reference (the neuron generator draws the same stream). `python -m
tests.test_compile_opinfo` prints the whole table.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch._dynamo

from opinfo_harness import OPS, op_id, pytorch_skips_compare_cpu, run_seeded, to_cpu, to_cpu_tree

DTYPE = torch.float32
SAMPLES = 2
BATCH = 24
ATOL, RTOL = 1e-4, 1e-4  # generated code reassociates reductions and fuses (e.g. fma): float tolerance
TARGET = 0.98

# Not counted: PyTorch itself excludes these from CPU comparison (uninitialised or device-defined outputs).
EXCLUDED = {name for name, op in OPS.items() if pytorch_skips_compare_cpu(op)}
# Known failures, each with its reason (the closing note lists them).
KNOWN: dict[str, str] = {}


def _ops() -> list[str]:
    return sorted(name for name, op in OPS.items() if op.supports_dtype(DTYPE, "cpu") and name not in EXCLUDED)


def _random(op) -> bool:
    return bool(getattr(op, "is_factory_function", False)) or any(
        s in op.name for s in ("rand", "normal", "bernoulli", "dropout", "multinomial", "uniform", "exponential",
                               "geometric", "cauchy", "poisson", "rrelu", "log_normal"))


def _samples(op) -> list:
    torch.manual_seed(0)
    out = []
    for s in op.sample_inputs("neuron", DTYPE, requires_grad=False):
        out.append(s)
        if len(out) == SAMPLES:
            break
    return out


def _compiled_run(cases: list) -> list:
    """Run [(op, sample), ...] inside one compiled function; returns the outputs."""
    torch._dynamo.reset()

    def batch():
        return [s.output_process_fn_grad(op(s.input, *s.args, **s.kwargs)) for op, s in cases]

    return run_seeded(torch.compile(batch, backend="neuron"))


def _check(op, sample, out) -> None:
    cpu = sample.transform(to_cpu)
    ref = run_seeded(lambda: cpu.output_process_fn_grad(op(cpu.input, *cpu.args, **cpu.kwargs)))
    torch.testing.assert_close(to_cpu_tree(out), ref, atol=ATOL, rtol=RTOL, equal_nan=True, check_device=False)


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    for line in text.splitlines():
        if "CompileError" in line or "Error" in line:
            return line.strip()[:300]
    return text.splitlines()[0][:300]


def _run_alone(name: str) -> str | None:
    op = OPS[name]
    try:
        cases = [(op, s) for s in _samples(op)]
        outs = _compiled_run(cases)
        for (o, s), out in zip(cases, outs):
            _check(o, s, out)
    except Exception as e:  # noqa: BLE001 - the sweep records every failure with its first line
        return _first_line(e)
    return None


@functools.cache
def sweep() -> dict[str, str | None]:
    """op name -> None (pass) or the failure."""
    names = _ops()
    if os.environ.get("TORCHNEURON_OPINFO_LIMIT"):
        names = names[:int(os.environ["TORCHNEURON_OPINFO_LIMIT"])]
    results: dict[str, str | None] = {}
    alone = [n for n in names if _random(OPS[n])]
    batched = [n for n in names if n not in alone]
    for i in range(0, len(batched), BATCH):
        chunk = batched[i:i + BATCH]
        try:
            cases = [(OPS[n], s, n) for n in chunk for s in _samples(OPS[n])]
            outs = _compiled_run([(op, s) for op, s, _ in cases])
            for (op, s, n), out in zip(cases, outs):
                try:
                    _check(op, s, out)
                    results.setdefault(n, None)
                except AssertionError as e:
                    results[n] = _first_line(e)
        except Exception:  # noqa: BLE001 - find the op(s) responsible
            alone.extend(chunk)
    for n in alone:
        results[n] = _run_alone(n)
    return results


@pytest.fixture(scope="module")
def results():
    old = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 10**6
    try:
        yield sweep()
    finally:
        torch._dynamo.config.recompile_limit = old


@pytest.mark.slow
def test_pass_rate(results):
    failed = {n: r for n, r in results.items() if r is not None}
    unexpected = {n: r for n, r in failed.items() if n not in KNOWN}
    rate = 1 - len(failed) / len(results)
    print(f"\nOpInfo through torch.compile(backend='neuron'), float32 forward, first {SAMPLES} samples: "
          f"{len(results) - len(failed)}/{len(results)} ops pass ({rate:.1%}); {len(EXCLUDED)} excluded")
    for n, r in sorted(failed.items()):
        print(f"  {n}: {KNOWN.get(n, 'UNEXPECTED')} | {r}")
    assert not unexpected, f"unexpected failures: {unexpected}"
    assert rate >= TARGET


if __name__ == "__main__":
    torch._dynamo.config.recompile_limit = 10**6
    res = sweep()
    bad = {n: r for n, r in res.items() if r is not None}
    print(f"{len(res) - len(bad)}/{len(res)} pass")
    for n, r in sorted(bad.items()):
        print(f"{n}\t{r}")
