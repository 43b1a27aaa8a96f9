"""`torchneuron profile`: the argument definitions and the runner that torchneuron.cli plugs in as a subcommand."""
from __future__ import annotations

import argparse
import os

import torch

from ..costmodel.cli import at_least, usage_error
from ..hardware.chips import CHIPS
from ..runtime.script import run_as_main
from .trace import profile


def _device_type(text: str) -> str:
    """An argparse type: 'all' or a device type PyTorch knows (cpu, neuron, meta, ...)."""
    if text != "all":
        try:
            torch.device(text)
        except RuntimeError:
            raise argparse.ArgumentTypeError(f"expected 'all' or a device type such as neuron or cpu, got "
                                             f"{text!r}") from None
    return text


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("script", help="a Python script to run under the profiler")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.add_argument("--device", type=_device_type, default="neuron",
                   help="record ops on this device type ('all': every device)")
    p.add_argument("--target", choices=sorted(CHIPS), help="chip to model (default: the configured one)")
    p.add_argument("--trace", default="torchneuron_trace.json", help="Chrome / Perfetto trace to write")
    p.add_argument("--top", type=at_least(0), default=20, help="ops in the summary table (>= 0)")


def run_profile(a: argparse.Namespace) -> int:
    error = a.parser.error if "parser" in a else usage_error
    if not os.path.isfile(a.script):
        error(f"no such script: {a.script}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(a.trace))):
        error(f"--trace {a.trace!r}: its directory does not exist")

    with profile(device=None if a.device == "all" else a.device, target=a.target) as prof:
        code = run_as_main(a.script, a.args)  # however it ends (`sys.exit(main())`, an exception): reported
    print(prof.summary(a.top))
    print(f"wrote {prof.export_chrome_trace(a.trace)} (open in https://ui.perfetto.dev)")
    return code
