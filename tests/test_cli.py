"""The `torchneuron` command: info (the modelled machine), and that every subcommand is wired."""
import json
import subprocess
import sys

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


def test_console_script_lists_every_command():
    p = subprocess.run([sys.executable, "-m", "torchneuron.cli", "--help"], capture_output=True, text=True)
    for name in ("check", "fix", "info", "estimate", "profile", "run"):
        assert name in p.stdout
