"""PyTorch's OpInfo database on `neuron` beyond float32 forward/backward (test_opinfo.py): other dtypes,
non-contiguous samples, `out=` and in-place variants against the CPU, and every declared error input raising the
declared exception type (the one CPU and CUDA raise) with its message.

Bounded for CI time: the first sample of each op per check (SAMPLES), and one dtype other than float32 per op.
Run under TORCHNEURON_DTYPE_POLICY=host semantics like test_opinfo.py. Known failures are strict xfails, with the
reason, in XFAIL (one table).
"""

import pytest
import torch
from opinfo_harness import (
    OPS,
    check_error_inputs,
    compare_inplace,
    compare_out,
    compare_samples,
    pytorch_skips_compare_cpu,
)
from test_opinfo import EXCLUDED, SPARSE, host_policy  # noqa: F401  (autouse: the host dtype policy)

SAMPLES = 1
TOLERANCES = {torch.bfloat16: (1e-2, 1.6e-2), torch.float16: (1e-3, 1e-3), torch.float32: (1e-3, 1e-3),
              torch.int64: (0, 0), torch.bool: (0, 0)}
RUN = sorted(n for n in OPS if n not in EXCLUDED | SPARSE)


def supported(dtype: torch.dtype) -> list[str]:
    return [n for n in RUN if dtype in OPS[n].supported_dtypes("cpu")]


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


DTYPES = (torch.bfloat16, torch.float16, torch.int64, torch.bool)
FLOAT32 = supported(torch.float32)
OUT = [n for n in FLOAT32 if OPS[n].supports_out and not pytorch_skips_compare_cpu(OPS[n], "test_out")]
INPLACE = [n for n in FLOAT32 if OPS[n].inplace_variant is not None]
ERRORS = [n for n in RUN
          if OPS[n].error_inputs_func is not None and not pytorch_skips_compare_cpu(OPS[n], "test_errors")]

# (check, op) -> why it fails today. Checks: bfloat16, float16, int64, bool, noncontiguous, out, inplace, errors.
XFAIL: dict[tuple[str, str], str] = {
    ("errors", "narrow_copy"): "neuron runs the CPU's narrow_copy kernel: RuntimeError and the CPU's messages where "
                               "CUDA's composite raises IndexError / 'length must be non-negative'",
}
CHECKS = {short(d) for d in DTYPES} | {"noncontiguous", "out", "inplace", "errors"}


def cases(check: str, names: list[str], *extra) -> list:
    """Parameters of one check, XFAIL's entries marked strict (a fixed op fails the run until its entry goes)."""
    return [pytest.param(n, *extra, marks=pytest.mark.xfail(reason=XFAIL[check, n], strict=True))
            if (check, n) in XFAIL else pytest.param(n, *extra) for n in names]


def rotated_dtype_cases() -> list:
    """One other dtype per op, rotating through DTYPES over the ops that support each (CI time: every op and every
    dtype is covered, not every pair)."""
    out, turn = [], 0
    for n in RUN:
        extra = [d for d in DTYPES if d in OPS[n].supported_dtypes("cpu")]
        if extra:
            d = extra[turn % len(extra)]
            turn += 1
            out += cases(short(d), [n], d)
    return out


DTYPE_CASES = rotated_dtype_cases()


def compared(n: int, what: str) -> None:
    """A case whose check compared nothing skips (saying so) instead of passing."""
    if n == 0:
        pytest.skip(f"no sample {what}")


@pytest.mark.parametrize("name,dtype", DTYPE_CASES, ids=lambda v: short(v) if isinstance(v, torch.dtype) else v)
def test_forward_dtypes(name, dtype):
    compared(compare_samples(OPS[name], dtype, SAMPLES, *TOLERANCES[dtype]), "in this dtype")


@pytest.mark.parametrize("name", cases("noncontiguous", FLOAT32))
def test_forward_noncontiguous(name):
    compared(compare_samples(OPS[name], torch.float32, SAMPLES, *TOLERANCES[torch.float32], noncontiguous=True),
             "to compare non-contiguous")


@pytest.mark.parametrize("name", cases("out", OUT))
def test_out_variant(name):
    compared(compare_out(OPS[name], torch.float32, SAMPLES, *TOLERANCES[torch.float32]), "with an out= result")


@pytest.mark.parametrize("name", cases("inplace", INPLACE))
def test_inplace_variant(name):
    compared(compare_inplace(OPS[name], torch.float32, SAMPLES, *TOLERANCES[torch.float32]), "for in-place")


@pytest.mark.parametrize("name", cases("errors", ERRORS))
def test_error_inputs(name):
    compared(check_error_inputs(OPS[name]), "error input the CPU rejects")


def test_coverage():
    assert len(DTYPE_CASES) > 600 and len(OUT) > 250 and len(INPLACE) > 150 and len(ERRORS) > 150, \
        (len(DTYPE_CASES), len(OUT), len(INPLACE), len(ERRORS))
    assert {check for check, _ in XFAIL} <= CHECKS and all(n in OPS for _, n in XFAIL)
