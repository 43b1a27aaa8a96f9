"""The records `check` produces and `fix`, the report formats and the command line read: one finding, and a run's
report. A module of its own so that the formats (output.py) and the event analysis (events.py) need not import
`check`, which imports them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .visitor import Site


@dataclass
class Finding:
    path: str
    line: int
    col: int  # 1-based, like ruff and SARIF
    code: str
    message: str
    fix: str  # auto | suggest | report: what `torchneuron fix` does with it here
    site: Site | None = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("path", "line", "col", "code", "message", "fix")}


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # skipped paths, with why
    files: int = 0
    seconds: float = 0.0  # wall clock
    cpu: float = 0.0  # CPU time (workers included): the rate that does not depend on the machine's load
    errors: int = 0  # files the tool failed on (each also an NRN000 finding)
