"""PyTorch's OpInfo database through `torch.compile(backend="neuron")`, compared with eager CPU (float32
forward).

Samples are made on `neuron`; each op's first SAMPLES samples (TORCHNEURON_OPINFO_SAMPLES, default 2, to fit CI
time) are compiled and run, and compared with the op on CPU copies of the same samples. Ops are compiled BATCH at
a time in one function written as straight-line code, so a graph break in one op ends that graph and Dynamo
compiles the next statements as a new one; each op is recorded as compiled (in a neuron graph) or eager (Dynamo
left it out of every graph, e.g. data-dependent outputs). A batch that fails is rerun op by op, so every failure
is an op's own. Random ops run alone, seeded like the CPU reference (the neuron generator draws the same stream).
Kernels land in the normal compile cache (TORCHNEURON_CACHE_DIR), so a rerun is fast.
`python tests/test_compile_opinfo.py` prints the whole table.
"""
from __future__ import annotations

import functools
import os
import re

import pytest
import torch
import torch._dynamo
from helpers import to_cpu, to_cpu_tree
from opinfo_harness import OPS, pytorch_skips_compare_cpu

DTYPE = torch.float32
SAMPLES = int(os.environ.get("TORCHNEURON_OPINFO_SAMPLES", "2"))
BATCH = 24
ATOL, RTOL = 1e-4, 1e-4  # generated code reassociates reductions and fuses (e.g. fma): float tolerance
TARGET = 0.98

# Not counted: PyTorch itself excludes these from CPU comparison (uninitialised or device-defined outputs).
EXCLUDED = {name for name, op in OPS.items() if pytorch_skips_compare_cpu(op)}
# Known failures, each with its reason.
_SPARSE = "the device stores only strided tensors: the op's sparse result raises NotImplementedError, as in eager"
KNOWN: dict[str, str] = {"sparse.mm.reduce": _SPARSE, "sparse.sampled_addmm": _SPARSE, "to_sparse": _SPARSE}
NA = "n/a: "  # the CPU reference itself fails (e.g. CUDA-only jiterator ops): not comparable, not counted


def run_seeded(fn, seed: int = 1234):
    torch.manual_seed(seed)  # seeds the CPU and every neuron generator alike
    return fn()


def _ops() -> list[str]:
    return sorted(name for name, op in OPS.items() if op.supports_dtype(DTYPE, "cpu") and name not in EXCLUDED)


def _random(op) -> bool:
    return bool(getattr(op, "is_factory_function", False)) or any(
        s in op.name for s in ("rand", "normal", "bernoulli", "dropout", "multinomial", "uniform", "exponential",
                               "geometric", "cauchy", "poisson", "rrelu", "log_normal"))


def _samples(op, device: str = "neuron") -> list:
    torch.manual_seed(0)
    out = []
    for s in op.sample_inputs(device, DTYPE, requires_grad=False):
        out.append(s)
        if len(out) == SAMPLES:
            break
    return out


SOURCE = "<opinfo-batch>"
_IN_GRAPH: set[int] = set()  # source lines of the batch function that Dynamo put into a compiled graph


def _recording_backend(gm, example_inputs, **kwargs):
    from torchneuron.compiler.backend import neuron_backend

    for n in gm.graph.nodes:
        _IN_GRAPH.update(int(x) for x in re.findall(rf'"{SOURCE}", line (\d+)', n.meta.get("stack_trace") or ""))
    return neuron_backend(gm, example_inputs, **kwargs)


def _batch_fn(n: int):
    """n cases as straight-line code, one statement (line i + 2) per case: a graph break in one case ends
    that graph, and Dynamo compiles the following statements as a new graph."""
    src = ["def batch(c):"] + [f"    r{i} = c[{i}][4](c[{i}][0](c[{i}][1], *c[{i}][2], **c[{i}][3]))"
                               for i in range(n)] + [f"    return [{', '.join(f'r{i}' for i in range(n))}]"]
    ns: dict = {}
    exec(compile("\n".join(src), SOURCE, "exec"), ns)
    return ns["batch"]


def _compiled_run(cases: list) -> tuple[list, list[bool]]:
    """Run [(op, sample), ...] in one compiled function: (outputs, whether each case ran in a compiled graph)."""
    torch._dynamo.reset()
    _IN_GRAPH.clear()
    args = [(op, s.input, s.args, s.kwargs, s.output_process_fn_grad) for op, s in cases]
    fn = torch.compile(_batch_fn(len(cases)), backend=_recording_backend)
    outs = run_seeded(lambda: fn(args))
    return outs, [i + 2 in _IN_GRAPH for i in range(len(cases))]


def _check(op, sample, out) -> None:
    # random ops: the compiled draws must equal eager neuron's (the neuron generator is Philox, the CPU's mt19937)
    ref_sample = sample if _random(op) else sample.transform(to_cpu)
    ref = to_cpu_tree(run_seeded(lambda: ref_sample.output_process_fn_grad(
        op(ref_sample.input, *ref_sample.args, **ref_sample.kwargs))))
    torch.testing.assert_close(to_cpu_tree(out), ref, atol=ATOL, rtol=RTOL, equal_nan=True, check_device=False)


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    for line in text.splitlines():
        if "CompileError" in line or "Error" in line:
            return line.strip()[:300]
    return text.splitlines()[0][:300]


COMPILED, EAGER = "compiled", "eager"  # passing outcomes: in a neuron graph, or left to eager by Dynamo


def _outcome(cases: list, outs: list, in_graph: list[bool], names: list[str], results: dict) -> None:
    for (op, s), out, compiled, n in zip(cases, outs, in_graph, names, strict=True):
        try:
            _check(op, s, out)
        except AssertionError as e:
            results[n] = _first_line(e)
            continue
        if results.get(n) in (None, EAGER):
            results[n] = COMPILED if compiled else results.get(n, EAGER)


def _cpu_failure(op) -> str | None:
    try:
        for s in _samples(op, "cpu"):
            torch.manual_seed(1234)
            op(s.input, *s.args, **s.kwargs)
    except Exception as e:  # noqa: BLE001
        return _first_line(e)
    return None


def _run_alone(name: str, results: dict) -> None:
    op = OPS[name]
    try:
        cases = [(op, s) for s in _samples(op)]
        outs, in_graph = _compiled_run(cases)
    except Exception as e:  # noqa: BLE001 - the sweep records every failure with its first line
        cpu = _cpu_failure(op)
        results[name] = NA + cpu if cpu else _first_line(e)
        return
    _outcome(cases, outs, in_graph, [name] * len(cases), results)


@functools.cache
def sweep() -> dict[str, str]:
    """op name -> COMPILED or EAGER (both pass: results equal CPU) or the failure."""
    names = _ops()
    if os.environ.get("TORCHNEURON_OPINFO_LIMIT"):
        names = names[:int(os.environ["TORCHNEURON_OPINFO_LIMIT"])]
    results: dict[str, str] = {}
    alone = [n for n in names if _random(OPS[n])]
    batched = [n for n in names if n not in alone]
    for i in range(0, len(batched), BATCH):
        chunk = batched[i:i + BATCH]
        try:
            cases = [(OPS[n], s, n) for n in chunk for s in _samples(OPS[n])]
            outs, in_graph = _compiled_run([(op, s) for op, s, _ in cases])
        except Exception:  # noqa: BLE001 - rerun op by op to find the op(s) responsible
            alone.extend(chunk)
            continue
        _outcome([(op, s) for op, s, _ in cases], outs, in_graph, [n for *_, n in cases], results)
    for n in alone:
        _run_alone(n, results)
    return results


def summary(results: dict[str, str]) -> tuple[float, dict[str, str], str]:
    counted = {n: r for n, r in results.items() if not r.startswith(NA)}
    failed = {n: r for n, r in counted.items() if r not in (COMPILED, EAGER)}
    rate = 1 - len(failed) / len(counted)
    eager = sum(r == EAGER for r in counted.values())
    text = (f"OpInfo through torch.compile(backend='neuron'), float32 forward, first {SAMPLES} sample(s) per op: "
            f"{len(counted) - len(failed)}/{len(counted)} ops pass ({rate:.1%}; {eager} of them ran eagerly "
            f"because Dynamo breaks the graph on them); not counted: {len(results) - len(counted)} whose CPU "
            f"reference fails, {len(EXCLUDED)} that PyTorch excludes from CPU comparison")
    return rate, failed, text


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
    rate, failed, text = summary(results)
    print("\n" + text)
    for n, r in sorted(failed.items()):
        print(f"  {n}: {KNOWN.get(n, 'UNEXPECTED')} | {r}")
    print("  fixed since listed as known:", sorted(n for n in KNOWN if results.get(n) in (COMPILED, EAGER)))
    unexpected = {n: r for n, r in failed.items() if n not in KNOWN}
    assert not unexpected, f"unexpected failures: {unexpected}"
    assert rate >= TARGET


if __name__ == "__main__":
    torch._dynamo.config.recompile_limit = 10**6
    res = sweep()
    print(summary(res)[2])
    for n, r in sorted(res.items()):
        print(f"{n}\t{r}")
