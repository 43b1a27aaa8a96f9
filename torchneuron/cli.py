"""The `torchneuron` command. Subcommands are rows of `COMMANDS`; each imports its work only when run, so
`torchneuron check`/`fix` start fast and never load torch or the device."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
DESCRIPTION = ("torchneuron: find and fix CUDA lock-in, run CUDA scripts unmodified on the neuron device, show the "
               "modelled Trainium machine, and estimate or profile a model's Trainium performance and cost.")


def _paths(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or directories (searched recursively)")


def _check_args(p: argparse.ArgumentParser) -> None:
    _paths(p)
    p.add_argument("--format", choices=("text", "json", "sarif"), default="text")
    p.add_argument("-j", "--jobs", type=int, default=1, metavar="N", help="worker processes, >= 0 (0: one per CPU)")


def _check(a: argparse.Namespace) -> int:
    from .migrate import check

    if a.jobs < 0:
        a.parser.error(f"-j/--jobs must be >= 0 (0: one per CPU), got {a.jobs}")
    return check.run(a.paths, a.format, a.jobs)


def _fix_args(p: argparse.ArgumentParser) -> None:
    _paths(p)
    p.add_argument("--write", action="store_true", help="rewrite the files in place (default: print a diff)")


def _fix(a: argparse.Namespace) -> int:
    from .migrate import fix
    return fix.run(a.paths, a.write)


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", metavar="OUT", help="save the porting report (.json, .md, else text)")
    p.add_argument("script", help="a CUDA Python script, run unmodified on neuron")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def _run(a: argparse.Namespace) -> int:
    """Run the script as `python script.py` would (runtime/script.py), then print the porting report, whatever the
    script's outcome."""
    from .hardware import config
    from .integrations import cuda_compat, porting_report
    from .runtime.script import run_as_main

    if not os.path.isfile(a.script):
        a.parser.error(f"no such script: {a.script}")
    cuda_compat.enable()
    # the processes the script starts (mp.spawn, subprocess) run in the mode too
    with config.scoped_env("TORCHNEURON_CUDA_COMPAT", "1"):
        code = run_as_main(a.script, a.args)
    porting_report.write(a.report or "-")
    return code


def _info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _info(a: argparse.Namespace) -> int:
    import dataclasses
    import json

    import torch

    from .device.module import config
    from .integrations import found
    from .runtime import patches

    try:
        cfg = config()
    except RuntimeError as e:  # an invalid configuration (environment variables): say which, no traceback
        print(f"torchneuron info: {e}", file=sys.stderr)
        return 1
    integrations = found()
    facts = {
        "torch": torch.__version__, "instance": cfg.instance.name, "chip": cfg.chip.name,
        "core": cfg.chip.core_version, "chips": cfg.instance.chips, "lnc": cfg.lnc,
        "logical_cores_per_chip": cfg.cores_per_chip, "visible_cores": list(cfg.visible_cores),
        "core_capacity_bytes": cfg.core_capacity, "memory_limit_override": cfg.memory_limit_override,
        "dtype_policy": cfg.dtype_policy, "fallback_policy": cfg.fallback_policy,
        "hbm_per_chip_bytes": cfg.chip.hbm_bytes, "supported_dtypes": list(cfg.chip.dtypes),
        "integrations": [dataclasses.asdict(i) for i in integrations],
        "patches": [{"name": p.name, "target": p.target, "why": p.why, "when": p.when, "undo": not p.no_undo}
                    for p in patches.active()],
    }
    if a.json:
        print(json.dumps(facts, indent=1))
        return 0
    print(f"torchneuron on torch {facts['torch']}: a modelled {cfg.instance.name} ({cfg.instance.chips} x "
          f"{cfg.chip.name}, {cfg.chip.core_version})")
    print(f"  logical cores  {torch.neuron.device_count()} visible {list(cfg.visible_cores)} of "
          f"{cfg.cores_per_chip * cfg.instance.chips} (NEURON_LOGICAL_NC_CONFIG={cfg.lnc}: {cfg.lnc} physical per "
          f"logical core)")
    print(f"  memory         {cfg.core_capacity / 2**30:.2f} GiB per core"
          f"{' (TORCHNEURON_MEMORY_LIMIT)' if cfg.memory_limit_override else ''}, "
          f"{cfg.chip.hbm_bytes >> 30} GiB HBM per chip")
    print(f"  dtypes         {', '.join(cfg.chip.dtypes)} (no float64; int64 computes as 32-bit)")
    print(f"  policies       TORCHNEURON_DTYPE_POLICY={cfg.dtype_policy} TORCHNEURON_FALLBACK={cfg.fallback_policy}")
    for i in range(torch.neuron.device_count()):
        free, total = torch.neuron.mem_get_info(i)
        print(f"  neuron:{i:<3}     {torch.neuron.get_device_name(i)}, logical core {cfg.visible_cores[i]}, "
              f"{(total - free) / 2**20:.1f} MiB of {total / 2**30:.1f} GiB in use")
    for i in integrations:
        print(f"  {i.library:<18} {i.version or 'not installed'}: "
              f"{'sees neuron' if i.sees_neuron else 'does NOT see neuron'} ({i.how})")
    print(f"  patches        {len(facts['patches'])} active (torchneuron.runtime.patches):")
    for p in patches.active():
        print(f"    {p.name:<36} {p.target}")
    return 0


def _estimate_args(p: argparse.ArgumentParser) -> None:
    from .costmodel.cli import add_estimate_arguments
    add_estimate_arguments(p)


def _estimate(a: argparse.Namespace) -> int:
    from .costmodel.cli import run_estimate
    return run_estimate(a)


def _profile_args(p: argparse.ArgumentParser) -> None:
    from .profiler.cli import add_profile_arguments
    add_profile_arguments(p)


def _profile(a: argparse.Namespace) -> int:
    from .profiler.cli import run_profile
    return run_profile(a)


# name -> (help, add_arguments, run). Other subcommands plug in here with one row each:
#   "info" (device and runtime facts), "run" (a CUDA script under compatibility mode, with a porting report),
#   "estimate" (the Trainium cost model), "profile" (the profiler).
COMMANDS: dict[str, Command] = {
    "check": ("find CUDA lock-in (exit 1 when something is found)", _check_args, _check),
    "fix": ("rewrite CUDA lock-in to device-agnostic PyTorch (diff, or --write)", _fix_args, _fix),
    "run": ("run a CUDA script unmodified on neuron (compatibility mode), then print a porting report",
            _run_args, _run),
    "info": ("show the modelled Trainium machine and the device configuration", _info_args, _info),
    "estimate": ("model a step's time, utilisation and cost on trn1/trn2/trn3 vs an H100", _estimate_args, _estimate),
    "profile": ("profile a model on `neuron`: modelled device time per op, Chrome trace", _profile_args, _profile),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchneuron", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (help_, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:  # only the chosen command builds its arguments (and imports what they need)
            add_args(p)
        p.set_defaults(run=run, parser=p)
    args = parser.parse_args(argv)
    if missing := [x for x in getattr(args, "paths", ()) if not os.path.exists(x)]:
        args.parser.error(f"no such file or directory: {', '.join(missing)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
