"""The `torchneuron` command. Subcommands are rows of `COMMANDS`; each imports its work only when run, so
`torchneuron check`/`fix` start fast and never load torch or the device."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or directories (searched recursively)")
    p.add_argument("--format", choices=("text", "json", "sarif"), default="text")


def _check(a: argparse.Namespace) -> int:
    from .migrate import check
    return check.run(a.paths, a.format)


def _fix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or directories (searched recursively)")
    p.add_argument("--write", action="store_true", help="rewrite the files in place (default: print a diff)")


def _fix(a: argparse.Namespace) -> int:
    from .migrate import fix
    return fix.run(a.paths, a.write)


# name -> (help, add_arguments, run). Other subcommands plug in here with one row each:
#   "info" (device and runtime facts), "run" (a CUDA script under compatibility mode, with a porting report),
#   "estimate" (the Trainium cost model), "profile" (the profiler).
COMMANDS: dict[str, Command] = {
    "check": ("find CUDA lock-in (exit 1 when something is found)", _check_args, _check),
    "fix": ("rewrite CUDA lock-in to device-agnostic PyTorch (diff, or --write)", _fix_args, _fix),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchneuron", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, add_args, run) in COMMANDS.items():
        add_args(p := sub.add_parser(name, help=help_, description=help_))
        p.set_defaults(run=run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
