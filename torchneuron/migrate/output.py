"""Report formats of `torchneuron check`: text (one line per finding and a summary), JSON, SARIF 2.1.0."""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from .rules import RULES

if TYPE_CHECKING:
    from .findings import Report

# ---- output -----------------------------------------------------------------------------------------------------

def format_text(rep: Report) -> str:
    lines = [f"{f.path}:{f.line}:{f.col}: {f.code} [{f.fix}] {f.message}" for f in rep.findings]
    kinds = {k: sum(f.fix == k for f in rep.findings) for k in ("auto", "suggest", "report")}
    rate = lambda t: f"{rep.files / t:.1f}" if t else "-"
    lines.append(f"{len(rep.findings)} findings ({', '.join(f'{n} {k}' for k, n in kinds.items())}) in "
                 f"{rep.files} files, {rep.seconds:.2f}s ({rate(rep.seconds)} files/s; "
                 f"CPU {rep.cpu:.2f}s, {rate(rep.cpu)} files/s)")
    return "\n".join(lines) + "\n"


def format_json(rep: Report) -> str:
    return json.dumps([f.as_dict() for f in rep.findings], indent=1) + "\n"


def format_sarif(rep: Report) -> str:
    """SARIF 2.1.0, as GitHub code scanning reads it."""
    index = {r.code: i for i, r in enumerate(RULES)}
    level = {"auto": "warning", "suggest": "warning", "report": "note"}
    rules = [{"id": r.code, "name": r.category, "shortDescription": {"text": r.message},
              "fullDescription": {"text": r.why}, "help": {"text": f"Replacement: {r.replacement or '(remove)'}"},
              "properties": {"fix": r.fix, "category": r.category}} for r in RULES]
    results = [{"ruleId": f.code, "ruleIndex": index[f.code], "level": "error" if f.code == "NRN000" else level[f.fix],
                "message": {"text": f.message},
                "locations": [{"physicalLocation": {"artifactLocation": {"uri": f.path.replace(os.sep, "/")},
                                                    "region": {"startLine": f.line, "startColumn": f.col}}}],
                "properties": {"fix": f.fix}} for f in rep.findings]
    notes = [{"level": "note", "message": {"text": n}} for n in rep.notes]
    run = {"tool": {"driver": {"name": "torchneuron", "informationUri": "https://github.com/torchneuron/torchneuron",
                               "rules": rules}},
           "results": results,
           "invocations": [{"executionSuccessful": not rep.errors, "toolExecutionNotifications": notes}]}
    return json.dumps({"$schema": "https://json.schemastore.org/sarif-2.1.0.json", "version": "2.1.0",
                       "runs": [run]}, indent=1) + "\n"


FORMATS = {"text": format_text, "json": format_json, "sarif": format_sarif}
