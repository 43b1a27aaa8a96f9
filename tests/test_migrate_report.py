"""The porting report: its data, text/Markdown/JSON renderings, and `torchneuron run --report` end to end."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

import torchneuron
from torchneuron.integrations import porting_report as report

SAMPLE = {
    "compat_enabled": True,
    "redirects": {"torch.cuda.amp.GradScaler": {"train.py:12": 1}, "Tensor.cuda": {"train.py:20": 8, "a.py:3": 2}},
    "executed_ops": {"aten::mm": 12, "aten::add_": 4}, "fallback_ops": {"aten::cholesky": 1},
    "dtype_events": {"aten::div": 2}, "eager_fusion": {"kernels": 3, "ops": 7, "compiled": 2,
                                               "compile_seconds": 8.25, "failures": 1, "over_budget": 4,
                                               "last_failure": "CppCompileError: x"},
    "memory": {"neuron:0": {"max_allocated": 3 << 20, "max_reserved": 4 << 20}},
    "compiled_graphs": [{"name": "f_0", "nodes": 4, "recompiles": 1, "graph_break": "print", "fallback": None,
                         "error": None}],
}


def test_collect_reads_the_device_counters():
    torch.ones(4, device="neuron").add(1)
    r = report.collect()
    assert r["executed_ops"]["aten::add"] >= 1 and r["executed_ops"] == torchneuron.get_executed_ops()
    assert set(r["memory"]) == {f"neuron:{i}" for i in range(torch.neuron.device_count())}
    json.dumps(r)  # JSON-ready as is


def test_text_and_markdown_show_every_section():
    text, md = report.render_text(SAMPLE), report.render_markdown(SAMPLE)
    for body in (text, md):
        assert "CUDA calls redirected (11)" in body and "Tensor.cuda: 10" in body and "train.py:20 x8" in body
        assert "host fallbacks: 1 (aten::cholesky x1)" in body and "aten::div x2" in body
        assert ("eager fusion: 3 fused kernels ran 7 queued ops; 2 kernels compiled in 8.2 s; 4 groups ran unfused, "
                "the compile budget spent (raise TORCHNEURON_FUSION_COMPILE_BUDGET); 1 groups ran unfused, not "
                "compilable (last: CppCompileError: x)") in body
        assert "f_0: 4 nodes, 1 recompiles, graph break: print" in body and "peak 3.00 MiB" in body
    assert md.startswith("# torchneuron porting report") and "## Ops" in md


def test_write_picks_the_format_by_suffix(tmp_path, capsys):
    for name in ("r.json", "r.md", "r.txt"):
        report.write(str(tmp_path / name), SAMPLE)
    assert json.loads((tmp_path / "r.json").read_text()) == SAMPLE
    assert (tmp_path / "r.md").read_text() == report.render_markdown(SAMPLE)
    assert (tmp_path / "r.txt").read_text() == report.render_text(SAMPLE)
    report.write("-", SAMPLE)
    assert capsys.readouterr().out == report.render_text(SAMPLE)


SCRIPT = '''
import sys
import torch
from torch.cuda.amp import GradScaler

assert sys.argv[1:] == ["--epochs", "2"] and __name__ == "__main__"
scaler = GradScaler()
print(torch.ones(2, device="cuda").add(1))

@torch.compile(backend="neuron")
def f(x):
    y = x.cuda() * 2
    print("graph break")
    return y + 1

f(torch.ones(3)); f(torch.ones(3))
sys.exit(3)
'''


def test_run_reports_redirects_ops_and_graph_breaks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "report.json"
    p = subprocess.run([sys.executable, "-m", "torchneuron.cli", "run", "--report", str(out), str(script),
                        "--epochs", "2"], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert p.returncode == 3, p.stderr[-3000:]  # the script's exit status, after the report was written
    r = json.loads(out.read_text())
    assert r["redirects"]["torch.cuda.amp.GradScaler"] == {f"{script}:7": 1}
    assert r["executed_ops"]["aten::add"] >= 1 and r["redirects"]["torch.ones(device=cuda)"] == {f"{script}:8": 1}
    assert any(g["graph_break"] for g in r["compiled_graphs"]), r["compiled_graphs"]
