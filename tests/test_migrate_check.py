"""`torchneuron check`: the rule table, findings on fixtures, suppression, bad input, output formats, flake8."""
import faulthandler
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchneuron.migrate import check, fix
from torchneuron.migrate.flake8_plugin import Plugin
from torchneuron.migrate.rules import BY_CODE, DOC_BEGIN, DOC_END, FIX_KINDS, RULES, TRIGGER, markdown

FIXTURES = Path(__file__).parent / "fixtures" / "migrate"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "input.py").exists())
HEADER = ("import os, subprocess\nimport torch\nimport torch.distributed as dist\nimport triton\n"
          "from torch.distributed.device_mesh import init_device_mesh\n"
          "from torch.nn.parallel import DistributedDataParallel as DDP\nfrom torch.profiler import ProfilerActivity\n")


def findings(src: str) -> list[tuple[int, int, str, str]]:
    return [(f.line, f.col, f.code, f.fix) for f in check.analyze(src).findings]


# ---- the table --------------------------------------------------------------------------------------------------

def test_table_is_complete_and_consistent():
    assert len(RULES) - 1 >= 40  # NRN000 is the parse-error code
    assert [r.code for r in RULES] == sorted(BY_CODE) and all(re.fullmatch(r"NRN\d{3}", c) for c in BY_CODE)
    cats = {r.category for r in RULES}
    assert {"device", "amp", "backend", "sync", "memory", "rng", "distributed", "compile", "extensions",
            "capability", "profiling", "data", "ladder"} <= cats
    for r in RULES:
        assert r.fix in FIX_KINDS and r.message and r.why and r.example, r.code
        if r.fix == "auto":
            assert check.template(r) is not None or r.replacement == "", r.code


def test_docs_show_the_current_table():
    doc = (Path(__file__).parents[1] / "docs" / "migration.md").read_text()
    assert doc.split(DOC_BEGIN)[1].split(DOC_END)[0] == markdown(), \
        "regenerate: python -m torchneuron.migrate.rules docs/migration.md"
    assert all(f"| {r.code} |" in doc for r in RULES)


@pytest.mark.parametrize("rule", RULES, ids=[r.code for r in RULES])
def test_each_rule_fires_on_its_example(rule):
    """The table's examples are the smallest code each rule must catch, with the declared fix kind."""
    offset = HEADER.count("\n")
    got = {(code, fix) for line, _, code, fix in findings(HEADER + rule.example) if line > offset}
    assert (rule.code, rule.fix) in got, got
    assert rule.code == "NRN000" or re.search(TRIGGER, rule.example), "the prefilter would skip this example"


@pytest.mark.parametrize("case", CASES)
def test_fixture_findings(case):
    expected = json.loads((FIXTURES / case / "expected_findings.json").read_text())
    got = [{"line": f.line, "col": f.col, "code": f.code, "fix": f.fix}
           for f in check.analyze((FIXTURES / case / "input.py").read_bytes()).findings]
    assert got == expected


# ---- resolution ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("src, code", [
    ("import torch.cuda as tc\ntc.synchronize()\n", "NRN040"),
    ("from torch.cuda.amp import autocast\nwith autocast():\n    pass\n", "NRN020"),
    ("from torch.cuda.amp import autocast as ac\n@ac()\ndef f():\n    pass\n", "NRN020"),
    ("from torch import cuda\ncuda.empty_cache()\n", "NRN050"),
    ("import torch as th\nth.cuda.is_available()\n", "NRN010"),
    ("from torch.cuda.memory import memory_allocated\nmemory_allocated()\n", "NRN051"),
    ("def f():\n    from torch.cuda import synchronize\n    synchronize()\n", "NRN040"),
    ("from torch.nn.parallel import DistributedDataParallel as D\nD(m, device_ids=[0])\n", "NRN074"),
])
def test_aliases_resolve(src, code):
    assert code in [c for _, _, c, _ in findings(src)]


@pytest.mark.parametrize("src", [
    "import cupy\ncupy.cuda.Device(0).use()\n",  # another library's cuda module
    "import tvm\ndev = tvm.cuda()\n",  # a module function named cuda
    "import numba.cuda\n@numba.cuda.jit\ndef k():\n    pass\n",
    "x = 'cudas'\ny = 'my cuda notes'\n",
    "import torch\nx = torch.zeros(2, device='cpu').to('cpu')\n",
])
def test_not_lock_in(src):
    assert findings(src) == []


def test_guard_keeps_cuda_only_code_on_cuda():
    src = "import torch\nif torch.cuda.is_available():\n    n = torch.cuda.get_device_capability()\n"
    assert findings(src) == [(2, 4, "NRN010", "suggest"), (3, 9, "NRN090", "report")]
    benign = "import torch\nif torch.cuda.is_available():\n    torch.backends.cudnn.benchmark = True\n"
    assert findings(benign)[0] == (2, 4, "NRN010", "auto")


def test_and_guards_like_if():
    """`available() and cuda_only()` keeps its CUDA check; `available() and portable()` needs no fallback."""
    src = ("import torch\nnew = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)\n"
           "busy = torch.cuda.is_available() and torch.cuda.memory_allocated() > 0\n")
    assert findings(src) == [(2, 7, "NRN010", "suggest"), (2, 37, "NRN090", "report"),
                             (3, 8, "NRN010", "auto"), (3, 38, "NRN051", "auto")]


def test_device_type_of_unknown_callables_is_a_suggestion():
    """`device_type="cuda"` in a test decorator may mean CUDA itself: only known APIs are rewritten."""
    src = ("import torch\nfrom torch.testing._internal.opinfo.core import DecorateInfo\n"
           "d = DecorateInfo(skip, device_type='cuda')\ntorch.set_autocast_enabled('cuda', True)\n")
    assert findings(src) == [(3, 36, "NRN009", "suggest"), (4, 28, "NRN006", "auto")]


def test_rewrite_conditions_downgrade_to_suggest():
    src = ("import torch\n"
           "s = torch.cuda.Stream(device='cuda:1')\n"  # names a device: no torch.Stream equivalent
           "with torch.cuda.stream(None):\n    pass\n"  # a None stream is not a context manager
           "torch.cuda.set_device('cuda:1')\n"  # the accelerator API wants an index
           "f = torch.cuda.synchronize\n"  # not called
           "x = y.cuda('cuda:1')\n")  # a string device
    got = {(line, code): fix for line, _, code, fix in findings(src)}
    assert got[(2, "NRN042")] == got[(3, "NRN043")] == got[(5, "NRN013")] == got[(6, "NRN040")] == "suggest"
    assert got[(7, "NRN001")] == "suggest"


# ---- suppression --------------------------------------------------------------------------------------------------

def test_noqa():
    src = (FIXTURES / "noqa" / "input.py").read_text()
    assert [(line, code) for line, _, code, _ in findings(src)] == [(5, "NRN004"), (6, "NRN001"), (8, "NRN040")]
    assert len(check.analyze(src, noqa=False).findings) == 7


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_syntax_error_is_reported(tmp_path):
    (tmp_path / "bad.py").write_text("import torch\ndef f(:\n    torch.cuda.synchronize()\n")
    (tmp_path / "plain_bad.py").write_text("def g(:\n")  # nothing CUDA in it: still reported
    rep = check.check_paths([str(tmp_path)])
    assert [(Path(f.path).name, f.line, f.col, f.code, f.fix, f.message) for f in rep.findings] == [
        ("bad.py", 2, 7, "NRN000", "report", "syntax error: invalid syntax"),
        ("plain_bad.py", 1, 7, "NRN000", "report", "syntax error: invalid syntax")]


def test_binary_huge_and_odd_files(tmp_path):
    (tmp_path / "blob.py").write_bytes(b"\x00\x01torch.cuda\x00" * 100)
    (tmp_path / "huge.py").write_text("x = 'cuda'\n" * (check.MAX_BYTES // 10))
    (tmp_path / "latin1.py").write_bytes(b"# -*- coding: latin-1 -*-\nimport torch\ns = '\xe9'\n"
                                         b"torch.cuda.synchronize()\n")
    (tmp_path / "crlf.py").write_bytes(b"import torch\r\n\r\nx.cuda()  # noqa\r\ny.cuda()\r\n")
    (tmp_path / "empty.py").write_text("")
    (tmp_path / "notes.txt").write_text("torch.cuda.synchronize()\n")
    rep = check.check_paths([str(tmp_path)])
    assert [(Path(f.path).name, f.line, f.code) for f in rep.findings] == [("blob.py", 1, "NRN000"),
                                                                            ("crlf.py", 4, "NRN001"),
                                                                            ("latin1.py", 4, "NRN040")]
    assert "null bytes" in rep.findings[0].message and rep.files == 5 and rep.errors == 0
    assert any("huge.py: skipped" in n and "limit" in n for n in rep.notes)


def test_symlinks_outside_the_tree_are_not_followed(tmp_path):
    outside, tree = tmp_path / "outside", tmp_path / "tree"
    outside.mkdir()
    (tree / "pkg").mkdir(parents=True)
    (outside / "secret.py").write_text("x.cuda()\n")
    (tree / "pkg" / "real.py").write_text("y.cuda()\n")
    os.symlink(outside / "secret.py", tree / "escape.py")
    os.symlink(outside, tree / "escape_dir")
    os.symlink(tree / "pkg" / "real.py", tree / "inside.py")
    rep = check.check_paths([str(tree)])
    assert sorted(Path(f.path).name for f in rep.findings) == ["inside.py", "real.py"]
    assert any("escape.py: symlink outside the tree" in n for n in rep.notes)
    assert any("escape_dir: symlinked directory not followed" in n for n in rep.notes)


def test_jobs_give_the_same_report(tmp_path):
    for i in range(6):
        (tmp_path / f"m{i}.py").write_text(f"import torch\nx = torch.zeros({i}).cuda()\n" + "y = 'cuda'\n" * i)
    (tmp_path / "bad.py").write_text("def f(:\n")
    one, two = check.check_paths([str(tmp_path)]), check.check_paths([str(tmp_path)], jobs=2)
    assert one.findings == two.findings and one.files == two.files == 7 and len(one.findings) == 22


def test_internal_errors_are_reported_not_raised(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x.cuda()\n")

    def boom(*a, **k):
        raise RecursionError("deep")
    monkeypatch.setattr(check, "analyze", boom)
    rep = check.check_paths([str(tmp_path)])
    assert [(f.code, f.message) for f in rep.findings] == [
        ("NRN000", "not analysed: internal error: RecursionError: deep")]
    assert rep.errors == 1


# ---- output -------------------------------------------------------------------------------------------------------

def test_formats(tmp_path):
    (tmp_path / "t.py").write_text("import torch\ntorch.cuda.synchronize()\nimport triton\n")
    rep = check.check_paths([str(tmp_path)])
    text = check.format_text(rep)
    assert f"{tmp_path}/t.py:2:1: NRN040 [auto]" in text
    assert re.search(r"2 findings \(1 auto, 0 suggest, 1 report\) in 1 files, [\d.]+s \([\d.]+ files/s; "
                     r"CPU [\d.]+s, ([\d.]+|-) files/s\)\n$", text)
    data = json.loads(check.format_json(rep))
    assert [{k: d[k] for k in ("line", "col", "code", "fix")} for d in data] == [
        {"line": 2, "col": 1, "code": "NRN040", "fix": "auto"},
        {"line": 3, "col": 8, "code": "NRN082", "fix": "report"}]
    assert set(data[0]) == {"path", "line", "col", "code", "message", "fix"}
    sarif = json.loads(check.format_sarif(rep))
    assert sarif["version"] == "2.1.0" and "sarif-2.1.0" in sarif["$schema"]
    run = sarif["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == [r.code for r in RULES]
    res = run["results"]
    assert [(r["ruleId"], r["level"], rules[r["ruleIndex"]]["id"]) for r in res] == [
        ("NRN040", "warning", "NRN040"), ("NRN082", "note", "NRN082")]
    assert res[0]["locations"][0]["physicalLocation"]["region"] == {"startLine": 2, "startColumn": 1}


# ---- flake8 -------------------------------------------------------------------------------------------------------

def test_flake8_plugin_class():
    lines = ["import torch\n", "x = torch.zeros(1).cuda()  # noqa: NRN001\n", "torch.cuda.synchronize()\n"]
    got = [(line, col, msg.split()[0]) for line, col, msg, _ in Plugin(None, lines, "t.py").run()]
    assert got == [(2, 19, "NRN001"), (3, 0, "NRN040")]  # flake8 columns are 0-based; flake8 applies noqa


def test_flake8_runs_the_plugin(tmp_path):
    pytest.importorskip("flake8")
    (tmp_path / "t.py").write_text("import torch\n\nx = torch.zeros(1).cuda()  # noqa: NRN001\n"
                                   "torch.cuda.synchronize()\n")
    r = subprocess.run([sys.executable, "-m", "flake8", "--select=NRN", str(tmp_path / "t.py")],
                       capture_output=True, text=True, timeout=300)
    assert r.stdout.splitlines() == [f"{tmp_path / 't.py'}:4:1: NRN040 " + BY_CODE["NRN040"].message
                                     + "; use `" + BY_CODE["NRN040"].replacement + "`"], r.stderr


# ---- a large real tree --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_check_the_installed_torch_package():
    """The acceptance run: every file of the installed torch, no crash, throughput reported."""
    import importlib.util
    root = os.path.dirname(importlib.util.find_spec("torch").origin)
    t0 = time.perf_counter()
    rep = check.check_paths([root])
    secs = time.perf_counter() - t0
    print(f"\ncheck over {root}: {rep.files} files in {secs:.0f}s = {rep.files / secs:.1f} files/s "
          f"(CPU {rep.cpu:.0f}s = {rep.files / rep.cpu:.1f} files/s), {len(rep.findings)} findings, "
          f"{len(rep.notes)} notes")
    assert rep.files > 2000 and len(rep.findings) > 1000
    assert rep.errors == 0 and not [f for f in rep.findings if "internal error" in f.message]


# ---- hostile input: deep and long expressions, malformed files, crashing workers -------------------------------

def _expr(kind: str, n: int) -> str:
    term = "torch.cuda.memory_allocated()"
    return {"sum": " + ".join([term] * n), "paren": "(" * n + term + ")" * n, "call": "f(" * n + term + ")" * n,
            "list": "[" + ", ".join([term] * n) + "]", "attr": term + ".real" * n,
            "unary": "-" * n + term, "subscript": term + "[0]" * n, "lambda": "lambda: " * n + term,
            "fstring": 'f"{' * min(n, 2) + term + '}"' * min(n, 2), "and": " and ".join([term] * n)}[kind]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(kind=st.sampled_from(["sum", "paren", "call", "list", "attr", "unary", "subscript", "lambda", "fstring",
                             "and"]), n=st.integers(1, 12_000))
def test_fuzz_deep_and_long_expressions(kind, n):
    """Never a crash; a file too deep for libcst is one clear NRN000 finding. (Time is bounded by the tool's own
    per-file limit, which turns a runaway file into a finding; this test asserts no wall-clock time.)"""
    src = f"import torch\nx = {_expr(kind, n)}\n"
    a = check.analyze(src)
    res = fix.fix_source(src)
    skipped = [f for f in a.findings if f.code == "NRN000"]
    assert skipped == [] or (len(a.findings) == 1 and skipped[0].message.startswith("not analysed: ")), a.findings
    if skipped:
        assert res.new == res.old
    else:
        assert {f.code for f in a.findings} <= {"NRN051"} and fix.grammars(res.new) is not None


def test_ten_thousand_terms_with_two_jobs(tmp_path):
    """The case from the field: one 10,000-term expression crashed libcst and broke the `-j 2` pool."""
    (tmp_path / "long.py").write_text("import torch\nx = " + " + ".join(["torch.cuda.memory_allocated()"] * 10_000)
                                      + "\n")
    (tmp_path / "ok.py").write_text("import torch\ntorch.cuda.synchronize()\n")
    out = io.StringIO()
    assert check.run([str(tmp_path)], jobs=2, out=out, err=io.StringIO()) == 1  # findings, not a tool error
    assert "long.py:1:1: NRN000 [report] not analysed: nested too deeply" in out.getvalue()
    assert "ok.py:2:1: NRN040" in out.getvalue()


MALFORMED = {
    "binary.py": bytes(range(256)) * 4,
    "nul.py": b"import torch\ntorch.cuda.synchronize()\x00\n",
    "truncated_utf8.py": "import torch\ns = 'caf\u00e9'\n".encode()[:-4],
    "bad_coding.py": b"# -*- coding: no-such-codec -*-\nimport torch\n",
    "latin1_undeclared.py": b"import torch\ns = '\xe9'\ntorch.cuda.synchronize()\n",
    "unterminated.py": b"import torch\ns = '''torch.cuda\n",
    "mixed_indent.py": b"import torch\nif x:\n\ttorch.cuda.synchronize()\n        y = 1\n",
    "deep_parens.py": b"import torch\nx = " + b"(" * 300 + b"torch.cuda" + b")" * 300 + b"\n",
    "long_line.py": b"x = [" + b"'cuda', " * 20_000 + b"]\n(\n",
    "bom_cr.py": b"\xef\xbb\xbfimport torch\rtorch.cuda.synchronize()\r",
}


def test_malformed_corpus(tmp_path):
    """Each malformed file: no crash, an NRN000 finding saying why (or, if Python reads it, the
    usual findings); `fix` writes none of the broken ones."""
    for name, data in MALFORMED.items():
        (tmp_path / name).write_bytes(data)
    rep = check.check_paths([str(tmp_path)], jobs=2)
    assert rep.errors == 0 and rep.files == len(MALFORMED)
    by_file = {}
    for f in rep.findings:
        by_file.setdefault(Path(f.path).name, []).append(f)
    for name in MALFORMED:
        if name == "bom_cr.py":  # valid Python: a BOM and old Mac line endings
            assert [f.code for f in by_file[name]] == ["NRN040"]
            continue
        assert by_file[name][0].code == "NRN000" and by_file[name][0].message, name
    before = {n: (tmp_path / n).read_bytes() for n in MALFORMED}
    assert fix.run([str(tmp_path)], write=True, out=io.StringIO(), err=io.StringIO()) in (0, 1)
    assert all((tmp_path / n).read_bytes() == before[n] for n in MALFORMED if n != "bom_cr.py")


def _crashing_worker(path: str) -> check.FileResult:
    check._STARTED.put((os.getpid(), path))
    if path.endswith("crash.py"):
        faulthandler.disable()
        os.kill(os.getpid(), signal.SIGSEGV)  # what a stack overflow in a native parser does
    return check.check_file(path)


def test_a_crashing_worker_is_a_tool_error_not_a_finding(tmp_path):
    files = []
    for i in range(6):
        (p := tmp_path / f"f{i}.py").write_text("import torch\ntorch.cuda.synchronize()\n")
        files.append(str(p))
    (crash := tmp_path / "crash.py").write_text("x = 1\n")
    files.insert(3, str(crash))
    results = check.map_files(check.check_file, _crashing_worker, files, 2, check._crashed)
    assert [r.error for r in results] == [p == str(crash) for p in files]
    assert "crashed" in results[3].findings[0].message
    assert all(r.findings[0].code == "NRN040" for i, r in enumerate(results) if i != 3)


def test_tool_errors_have_their_own_exit_code(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("import torch\ntorch.cuda.synchronize()\n")
    assert check.run([str(tmp_path)], out=io.StringIO(), err=io.StringIO()) == 1
    monkeypatch.setattr(check, "FILE_TIMEOUT", 0.001)
    monkeypatch.setattr(check, "analyze", lambda *a, **k: threading.Event().wait(60))  # ends at the time limit
    out, err = io.StringIO(), io.StringIO()
    assert check.run([str(tmp_path)], out=out, err=err) == check.TOOL_ERROR == 3
    assert "failed on 1 file" in err.getvalue() and "analysis took over" in out.getvalue(), out.getvalue()
    monkeypatch.setattr(fix, "fix_source", lambda *a, **k: 1 / 0)
    assert fix.run([str(tmp_path)], out=io.StringIO(), err=io.StringIO()) == 3


def test_many_files_with_two_jobs_do_not_block(tmp_path):
    """Workers announce each file on a pipe; more names than the pipe holds must not block the pool."""
    for i in range(1500):
        (tmp_path / f"{'long_module_name_' * 4}{i}.py").write_text("x = 1\n")
    (tmp_path / "a.py").write_text("import torch\ntorch.cuda.synchronize()\n")
    p = subprocess.run([sys.executable, "-m", "torchneuron.cli", "check", "-j", "2", str(tmp_path)],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 1 and "a.py:2:1: NRN040" in p.stdout and "in 1501 files" in p.stdout, p.stderr
