"""Shared test helpers. `import torch` autoloads the neuron device (the entry point under test)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from helpers import clean_env

import torchneuron


def run_py(code: str, env: dict | None = None, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Run Python code in a fresh interpreter (for environment-dependent behaviour); returns the process."""
    full_env = clean_env(**(env or {}))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=full_env, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"subprocess failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


# Every op the suite ran on neuron (C++ counters, eager) or compiled (the compiler's classification of each graph
# node), for the cross-layer check at the end of the session (tests/op_consistency.py).
_RAN: dict[str, set[str]] = {"executed": set(), "fallback": set()}
_COMPILED: dict[str, str] = {}
_ROWS_READ = [0]  # compile-metrics rows already read


def _collect_ops() -> None:
    """Read the counters before the next test clears them (cheap: names only, new metrics rows only)."""
    _RAN["executed"].update(dict(torchneuron._C._executed_ops()))
    _RAN["fallback"].update(dict(torchneuron._C._fallback_ops()))
    metrics = sys.modules.get("torchneuron.compiler.metrics")  # only when a test compiled something
    rows = metrics._ROWS if metrics else []
    if len(rows) < _ROWS_READ[0]:  # a test reset the metrics
        _ROWS_READ[0] = 0
    for row in rows[_ROWS_READ[0]:]:
        _COMPILED.update(row.get("op_engines", {}))
    _ROWS_READ[0] = len(rows)


@pytest.fixture(autouse=True)
def _device_state():
    """Each test starts on neuron:0 with the default policies and clean op counters."""
    torchneuron.set_policies("trainium", "warn")
    torchneuron.clear_op_tracking()
    torch.neuron.set_device(0)
    yield
    _collect_ops()
    torchneuron.set_policies("trainium", "warn")
    torch.neuron.set_device(0)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session when any op the suite ran or compiled is classified differently by two layers, or (with
    --verify-replay) when a replayed fusion plan differs from the one the group builder makes."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if session.config.getoption("--verify-replay"):
        checks = torchneuron._C._replay_checks()
        line = f"replay verification: {checks['verified']} replayed plans rebuilt, {checks['mismatched']} differed"
        if reporter:
            reporter.write_line(line + (f" (last: {checks['last']})" if checks["mismatched"] else ""))
        if checks["mismatched"]:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    from torchneuron.compiler import eager_fusion

    fusion = eager_fusion.stats()
    if reporter and fusion.compiled:
        reporter.write_line(f"eager fusion: {fusion.compiled} kernels compiled in {fusion.compile_seconds:.0f} s")
    if not (_RAN["executed"] or _RAN["fallback"] or _COMPILED):
        return
    from op_consistency import disagreements

    names = dict.fromkeys(_RAN["executed"] | _RAN["fallback"]) | _COMPILED
    bad = disagreements(names, _RAN["executed"], _RAN["fallback"])
    if not bad and reporter:
        reporter.write_line(f"op table consistency: the {len(names)} ops this session ran agree across layers")
    if bad:
        lines = [f"FAILED op table consistency: {len(bad)} disagreement(s) over the {len(names)} ops this session ran "
                 "(tests/op_consistency.py):", *bad]
        if reporter:
            reporter.write_line("\n".join(lines), red=True, bold=True)
        else:
            print("\n".join(lines))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--queue-everything", action="store_true",
                     help="queue every kernel (small ones on an idle stream too; first layouts from meta kernels) so "
                          "that the suite checks the queued path, which small test inputs would otherwise skip")
    parser.addoption("--verify-replay", action="store_true",
                     help="rebuild every replayed eager-fusion plan with the Python group builder and fail the session "
                          "when one differs (the C++ signature must capture everything the builder decides on)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--queue-everything"):
        torchneuron._C._set_queue_everything(True)
    if config.getoption("--verify-replay"):
        torchneuron._C._set_verify_replay(True)
