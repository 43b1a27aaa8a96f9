"""The `torchneuron` command: info (the modelled machine), and that every subcommand is wired."""
import json
import subprocess
import sys

import pytest
from conftest import run_py


def cli(*args, env=None):
    return run_py(f"import sys; from torchneuron.cli import main; sys.exit(main({list(args)!r}))", env)


def test_info_shows_the_modelled_machine():
    out = cli("info").stdout
    assert "trn2.3xlarge" in out and "Trainium2" in out and "24.00 GiB per core" in out
    assert "neuron:3" in out and "TORCHNEURON_DTYPE_POLICY=trainium" in out


def test_info_follows_the_environment():
    facts = json.loads(cli("info", "--json", env={"TORCHNEURON_INSTANCE": "trn1.32xlarge",
                                                   "TORCHNEURON_MEMORY_LIMIT": "1GiB"}).stdout)
    assert facts["chip"] == "Trainium1" and facts["chips"] == 16 and len(facts["visible_cores"]) == 32
    assert facts["core_capacity_bytes"] == 1 << 30 and facts["memory_limit_override"]


def test_info_names_an_invalid_configuration_without_a_traceback():
    p = run_py("import sys; from torchneuron.cli import main; sys.exit(main(['info']))",
               {"NEURON_RT_VISIBLE_CORES": "7"}, check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip() == "torchneuron info: NEURON_RT_VISIBLE_CORES='7' names cores [7], but the modelled " \
                               "machine has logical cores 0-3", p.stderr


def test_console_script_lists_every_command():
    p = subprocess.run([sys.executable, "-m", "torchneuron.cli", "--help"], capture_output=True, text=True)
    for name in ("check", "fix", "info", "estimate", "profile", "run"):
        assert name in p.stdout


def test_help_describes_the_tool_in_whole_sentences():
    from torchneuron.cli import DESCRIPTION

    p = subprocess.run([sys.executable, "-m", "torchneuron.cli", "--help"], capture_output=True, text=True)
    assert " ".join(p.stdout.split()).find(" ".join(DESCRIPTION.split())) > 0 and DESCRIPTION.endswith(".")


@pytest.mark.parametrize("argv,needle", [
    ("estimate --tp 1000", "--tp: the tensor-parallel degree must be in 1..64"),
    ("estimate --tp 5 --target trn1 --instance trn1.2xlarge", "must be in 1..2"),
    ("estimate --price nan", "--price: expected a finite number > 0, got 'nan'"),
    ("estimate --price -3", "--price: expected a finite number > 0"),
    ("estimate --price inf", "--price: expected a finite number > 0"),
    ("estimate --batch 0", "--batch: expected an integer >= 1, got '0'"),
    ("estimate --dp 0", "--dp: expected an integer >= 1"),
    ("estimate --dp two", "--dp: expected an integer >= 1, got 'two'"),
    ("estimate --seq 0", "--seq: expected an integer >= 1"),
    ("estimate --seq 4096", "--seq must be in 1..1024 for gpt2-small"),
    ("estimate --global-batch 3 --dp 2 --batch 2", "--global-batch must be at least --dp x --batch = 4"),
    ("estimate --lnc 3", "LNC=3 is not valid on Trainium2: choose (1, 2)"),
    ("estimate --target trn1 --instance trn2.48xlarge", "trn2.48xlarge has trn2 chips, not trn1"),
    ("estimate --top -1", "--top: expected an integer >= 0"),
    ("estimate --model nope", "use one of gpt2-small"),
    ("estimate --model nonexistent.py:make", "--model 'nonexistent.py:make': no file 'nonexistent.py'"),
    (f"estimate --model {__file__}:no_such_function", "defines no function 'no_such_function'"),
    ("estimate --model llama-1b --mode decode --speculate 4 --draft foo --acceptance 0.8", "--draft 'foo': use one of"),
    ("estimate --model llama-1b --ep 2 --dp 2", "ep=2 must divide the experts per layer"),
    ("profile --top -2 x.py", "--top: expected an integer >= 0"),
    ("profile --device gpu0 x.py", "--device: expected 'all' or a device type"),
    ("profile does_not_exist.py", "no such script: does_not_exist.py"),
    ("run does_not_exist.py", "no such script: does_not_exist.py"),
    ("check -j -1 .", "-j/--jobs must be >= 0"),
    ("fix does_not_exist.py", "no such file or directory"),
    ("info --verbose", "unrecognized arguments"),
])
def test_bad_arguments_are_usage_errors_naming_the_valid_range(argv, needle, capsys):
    """Exit status 2 and a usage line (argparse's usage error), never a traceback or a result for impossible
    input (`--tp 1000` used to print a 1000-core result, `--price nan` `$nan/h`)."""
    from torchneuron.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv.split())
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: torchneuron" in err and needle in err, err


def test_run_behaves_like_python_for_exits_and_tracebacks(tmp_path):
    """sys.exit("message") prints the message and exits 1, sys.exit(3) exits 3, an exception prints a traceback
    that starts at the script's own frame and exits 1; the porting report is printed every time."""
    scripts = {"message": 'import sys\nprint("started")\nsys.exit("cannot continue: bad input")\n',
               "status": "import sys\nsys.exit(3)\n",
               "raises": 'def load():\n    raise ValueError("bad value")\n\nload()\n'}
    procs = {}
    for name, text in scripts.items():
        (tmp_path / f"{name}.py").write_text(text)
        procs[name] = subprocess.Popen([sys.executable, "-m", "torchneuron.cli", "run", f"{name}.py"], cwd=tmp_path,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = {name: (*p.communicate(timeout=300), p.returncode) for name, p in procs.items()}
    runs = {name: (code, out, err) for name, (out, err, code) in runs.items()}
    for name, (_, out, err) in runs.items():
        assert "torchneuron porting report" in out, (name, out, err)
    code, out, err = runs["message"]
    assert code == 1 and err.strip().splitlines()[-1] == "cannot continue: bad input" and out.startswith("started")
    assert runs["status"][0] == 3
    code, out, err = runs["raises"]
    lines = err.strip().splitlines()
    assert code == 1 and lines[-1] == "ValueError: bad value", err
    tb = lines[lines.index("Traceback (most recent call last):"):]
    assert tb[1] == f'  File "{tmp_path / "raises.py"}", line 4, in <module>', err
    assert "cli.py" not in err and "runpy" not in err


def test_profile_reports_a_script_that_exits(tmp_path):
    """`torchneuron profile` of a script ending `sys.exit(main())` (or raising) still prints its summary and writes
    its trace, and exits with the script's status (the profile was lost before, with status 0)."""
    body = 'import sys, torch\nx = torch.randn(64, 64, device="neuron")\n(x @ x).sum().item()\n'
    for name, tail, status in (("exits", "sys.exit(3)\n", 3), ("raises", "raise ValueError('bad')\n", 1)):
        (tmp_path / f"{name}.py").write_text(body + tail)
        p = subprocess.run([sys.executable, "-m", "torchneuron.cli", "profile", "--trace", f"{name}.json",
                            f"{name}.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert p.returncode == status and "aten::mm" in p.stdout, (p.stdout, p.stderr)
        assert json.loads((tmp_path / f"{name}.json").read_text())["traceEvents"]
