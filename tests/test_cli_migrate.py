"""The `torchneuron check` / `torchneuron fix` command line: exit codes, formats, the subcommand table."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchneuron import cli

ROOT = Path(__file__).resolve().parents[1]
CUDA = "import torch\nx = torch.zeros(2).cuda()\ntorch.cuda.synchronize()\n"


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text(CUDA)
    (tmp_path / "clean.py").write_text("import torch\nx = torch.zeros(2)\n")
    return tmp_path


def test_check_exit_codes_and_text(tree, capsys):
    assert cli.main(["check", str(tree)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"{tree}/pkg/train.py:2:20: NRN001 [auto] `.cuda()` moves to CUDA only; use `x.to(device, ...)`",
                       f"{tree}/pkg/train.py:3:1: NRN040 [auto] `torch.cuda.synchronize()` is CUDA-only; use "
                       "`if torch.accelerator.is_available(): torch.accelerator.synchronize(...)`"]
    assert out[2].startswith("2 findings (2 auto, 0 suggest, 0 report) in 2 files") and "files/s" in out[2]
    assert cli.main(["check", str(tree / "clean.py")]) == 0


def test_check_json_and_sarif(tree, capsys):
    assert cli.main(["check", "--format", "json", str(tree)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [(Path(d["path"]).name, d["line"], d["col"], d["code"], d["fix"]) for d in data] == [
        ("train.py", 2, 20, "NRN001", "auto"), ("train.py", 3, 1, "NRN040", "auto")]
    assert cli.main(["check", "--format", "sarif", str(tree)]) == 1
    assert [r["ruleId"] for r in json.loads(capsys.readouterr().out)["runs"][0]["results"]] == ["NRN001", "NRN040"]


@pytest.mark.parametrize("argv", [[], ["check"], ["fix"], ["check", "--format", "xml", "."], ["frobnicate"],
                                  ["check", "does/not/exist.py"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "usage: torchneuron" in capsys.readouterr().err


def test_fix_diff_then_write(tree, capsys):
    train = tree / "pkg" / "train.py"
    assert cli.main(["fix", str(tree)]) == 1  # changes pending
    out = capsys.readouterr()
    assert out.out.startswith(f"--- a/{train}\n+++ b/{train}\n") and "+x = torch.zeros(2).to(device)\n" in out.out
    assert train.read_text() == CUDA
    assert cli.main(["fix", "--write", str(tree)]) == 0
    assert "rewrote 1 files (2 fixes)" in capsys.readouterr().err
    assert cli.main(["check", str(train)]) == 0
    capsys.readouterr()
    assert cli.main(["fix", str(tree)]) == 0 and capsys.readouterr().out == ""


def test_subcommands_are_a_table(monkeypatch, capsys):
    """Other subcommands plug in as one row: (help, add_arguments, run)."""
    def add(p):
        p.add_argument("--n", type=int, default=3)
    monkeypatch.setitem(cli.COMMANDS, "estimate", ("estimate cost", add, lambda a: print("n", a.n) or 0))
    assert cli.main(["estimate", "--n", "5"]) == 0 and capsys.readouterr().out == "n 5\n"
    assert set(cli.COMMANDS) >= {"check", "fix"}


def test_static_tools_do_not_import_torch(tree):
    """`check` and `fix` need neither torch nor the device: run them with the package's __init__ (which loads
    the device core) bypassed, and prove torch never gets imported."""
    boot = ("import sys, types; pkg = types.ModuleType('torchneuron'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['torchneuron'] = pkg; from torchneuron.cli import main; "
            "rc = [main(['check', sys.argv[2]]), main(['fix', sys.argv[2]])]; "
            "print('RESULT', rc, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", boot, str(ROOT / "torchneuron"), str(tree)], capture_output=True,
                       text=True, timeout=300)
    assert r.stdout.splitlines()[-1] == "RESULT [1, 1] False", r.stderr


def test_console_entry_point(tree):
    r = subprocess.run([sys.executable, "-m", "torchneuron.cli", "check", "--format", "json", str(tree)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 1, r.stderr
    assert [d["code"] for d in json.loads(r.stdout)] == ["NRN001", "NRN040"]
