"""`make bench`: every benchmarks/bench_*.py, at 1 thread and at 2, as neuron/CPU ratios in one process.

Usage: python -m benchmarks.run [--quick] [--only device,compile,...] [--threads 1,2] [--json out.json]
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import warnings

import torch

import benchmarks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--only", default="", help="comma-separated suite names, e.g. device,compile")
    ap.add_argument("--threads", default="1,2", help="thread counts to run each suite at")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    suites = sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(benchmarks.__path__)
                    if m.name.startswith("bench_"))
    if args.only:
        suites = [s for s in suites if s in args.only.split(",")]
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for suite in suites:
            mod = importlib.import_module(f"benchmarks.bench_{suite}")
            for r in mod.run(quick=args.quick):
                r.setdefault("suite", suite)
                r["threads"] = threads
                rows.append(r)
                target = f"<= {r['target']:.2f}x" if r.get("target") else ""
                print(f"{suite:<12} {threads}t  {r['name']:<50} neuron {r['neuron']:10.3f} {r['unit']:<3} "
                      f"cpu {r['cpu']:10.3f} {r['unit']:<3} ratio {r['ratio']:6.3f}x {target}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
