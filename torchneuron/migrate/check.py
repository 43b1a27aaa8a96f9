"""`torchneuron check`: find CUDA lock-in with libcst and qualified-name resolution, rule by rule from `rules.py`.

Static only: nothing here imports torch, so it runs fast, anywhere, and never needs a device.
"""
from __future__ import annotations

import ast
import contextlib
import io
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import tokenize
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TextIO

import libcst as cst

# `x as x`: re-exported, `check` is the module the tests and users import
from .findings import Finding as Finding
from .findings import Report as Report
from .matcher import MATCHER
from .matcher import template as template
from .output import FORMATS
from .output import format_json as format_json
from .output import format_sarif as format_sarif
from .output import format_text as format_text
from .rules import BENIGN, TRIGGER, shown
from .syntax import _Positions
from .visitor import ONLY as ONLY
from .visitor import Imports, _Visitor
from .visitor import free_quote as free_quote

MAX_BYTES = 2 << 20  # larger files are generated or data, not code to migrate
SKIP_DIRS = {"__pycache__", "node_modules", "venv", "site-packages"}
NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[,\s]+[A-Z]+[0-9]+)*))?", re.I)


@dataclass
class Analysis:
    path: str
    findings: list[Finding]
    module: cst.Module | None = None


# ---- analysis of one source -------------------------------------------------------------------------------------

def analyze(source: bytes | str, path: str = "<string>", noqa: bool = True, keep_tree: bool = False) -> Analysis:
    """Parse `source` and return its findings, sorted; `keep_tree` keeps the tree and rewrite sites for `fix`."""
    text = source if isinstance(source, str) else source.decode("utf-8", "replace")
    if isinstance(source, bytes) and (bad := _undecodable(source)):
        return Analysis(path, [Finding(path, 1, 1, "NRN000", f"not analysed: {bad}", "report")])
    if "\0" in text:
        return Analysis(path, [Finding(path, text.count("\n", 0, text.index("\0")) + 1, 1, "NRN000",
                                       "not analysed: null bytes (a binary file, not Python source)", "report")])
    tree, too_big = _size_guard(source, text)
    if too_big:  # libcst would overflow its stack (signal 11) or take minutes: report instead
        return Analysis(path, [Finding(path, too_big[0], 1, "NRN000", f"not analysed: {too_big[1]}", "report")])
    if tree is not None and not re.search(TRIGGER, text):  # nothing to find: the C parser's word is enough
        return Analysis(path, [])
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as e:
        line, col, msg = e.raw_line, e.raw_column + 1, f"libcst cannot parse this: {e.message}"
        try:
            ast.parse(source)
        except SyntaxError as se:  # Python's own parser locates and explains syntax errors better
            line, col, msg = se.lineno or line, se.offset or col, f"syntax error: {se.msg}"
        except Exception:
            pass
        return Analysis(path, [Finding(path, line, col, "NRN000", msg, "report")])
    except Exception as e:  # undecodable bytes, odd encodings: report, never crash
        msg = f"could not parse: {type(e).__name__}: {e}"
        return Analysis(path, [Finding(path, 1, 1, "NRN000", msg, "report")])
    v = _Visitor(MATCHER, Imports(module))
    v.walk(module)
    guarded = [b for bodies in v.guard_bodies.values() for b in bodies]
    pos = _Positions(module, [n for _, n, _, _ in v.hits] + guarded) if v.hits else None
    findings = []
    for rule, node, site, why in v.hits:
        line, col = pos.start[id(node)]
        fix = "auto" if site else "suggest" if rule.fix != "report" else "report"
        msg = rule.message + (f"; use `{shown(rule.replacement)}`" if rule.fix == "auto" and rule.replacement else
                              f"; {rule.replacement}" if rule.replacement else "; remove it")
        msg += f" [not rewritten: {why}]" if why else ""
        findings.append(Finding(path, line, col + 1, rule.code, msg, fix, site))
    _downgrade_guards(findings, v, pos)
    if any(f.code == "NRN041" and f.fix == "auto" and not f.site.guarded for f in findings):
        from .events import downgrade_escaping_events  # only files with events pay for its import
        downgrade_escaping_events(module, findings)
    if noqa:
        findings = suppress(findings, re.split(r"\r\n|\r|\n", text))
    findings.sort(key=lambda f: (f.line, f.col, f.code))
    if not keep_tree:  # sites hold the tree: let it go
        for f in findings:
            f.site = None
        return Analysis(path, findings)
    return Analysis(path, findings, module)


def _undecodable(source: bytes) -> str | None:
    """Why Python could not read `source` as text (its PEP 263 encoding, UTF-8 by default), or None."""
    try:
        encoding = tokenize.detect_encoding(io.BytesIO(source).readline)[0]
    except SyntaxError as e:
        return f"bad encoding declaration ({e})"
    try:
        source.decode(encoding)
    except (UnicodeDecodeError, LookupError) as e:
        return f"not valid {encoding} text ({e})"
    return None


MAX_DEPTH = 120  # syntax-tree nesting that libcst, its code generation and our walks handle in the default
#                  recursion limit (a chain of binary operators nests one level per operator)
MAX_NODES = 250_000  # syntax-tree size: libcst parses about 10,000 nodes a second
MAX_LINE = 50_000  # characters on one line, for files Python's parser rejects (the depth is then unknown)


def _size_guard(source: bytes | str, text: str) -> tuple[ast.AST | None, tuple[int, str] | None]:
    """Python's own syntax tree of `source` (None if it does not parse) and, when the file is too deep or too
    large for libcst, the line and reason. Checked before libcst ever sees the file."""
    try:
        tree = ast.parse(source)
    except (RecursionError, MemoryError):
        return None, (1, f"nested too deeply for Python's own parser (the limit for analysis is {MAX_DEPTH} levels)")
    except Exception:  # SyntaxError, a grammar newer than this Python: let libcst decide, if it is small and flat
        longest = max(((len(line), i) for i, line in enumerate(text.splitlines(), 1)), default=(0, 1))
        if longest[0] > MAX_LINE:
            return None, (longest[1], f"line of {longest[0]:,} characters (limit {MAX_LINE:,})")
        depth = deepest = 0
        for c in text:  # brackets, strings included: an over-estimate only skips a file Python rejects anyway
            depth += (c in "([{") - (c in ")]}")
            deepest = max(deepest, depth)
        if deepest > MAX_DEPTH // 2:
            return None, (1, f"brackets nested {deepest} deep in a file Python's parser rejects")
        return None, None
    stack, nodes = [(tree, 1)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if depth > MAX_DEPTH:
            return tree, (getattr(node, "lineno", 1), f"expression nested over {MAX_DEPTH} levels deep (e.g. a chain "
                          f"of thousands of operators); split it to have it checked")
        step = len(node.values) if isinstance(node, ast.BoolOp) else 1  # `a and b and c` nests in libcst
        stack.extend((c, depth + step) for c in ast.iter_child_nodes(node))
    if nodes > MAX_NODES:
        return tree, (1, f"{nodes:,} syntax-tree nodes (limit {MAX_NODES:,}): generated code?")
    return tree, None


def _downgrade_guards(findings: list[Finding], v: _Visitor, pos: _Positions | None) -> None:
    """`torch.cuda.is_available()` guarding code that stays CUDA-only (an `if` body, the rest of an `and`)
    must stay a CUDA check."""
    changed = True
    while changed:
        changed = False
        for f in findings:
            if f.fix != "auto" or f.code != "NRN010" or not isinstance(f.site.target, cst.Call):
                continue
            spans = [(pos.start[id(b)], pos.end[id(b)]) for b in v.guard_bodies.get(id(f.site.target.func), ())]
            inside = [g for g in findings if g.fix != "auto" and g.code not in BENIGN and
                      any(start <= (g.line, g.col - 1) <= end for start, end in spans)]
            if inside:
                f.fix, f.site, changed = "suggest", None, True
                f.message += f" [not rewritten: guards CUDA-only code ({inside[0].code})]"


def suppress(findings: list[Finding], lines: list[str]) -> list[Finding]:
    """Drop findings on lines with `# noqa` or `# noqa: NRN001,NRN002` naming their code."""
    def keep(f: Finding) -> bool:
        m = NOQA.search(lines[f.line - 1]) if 0 < f.line <= len(lines) else None
        return m is None or (m["codes"] is not None and f.code not in re.split(r"[,\s]+", m["codes"].upper()))
    return [f for f in findings if keep(f)]


# ---- files ------------------------------------------------------------------------------------------------------

def iter_files(paths: Iterable[str], notes: list[str]) -> Iterator[str]:
    """Python files under `paths`, recursively; symlinks are followed only when they stay inside the tree."""
    for root in paths:
        if os.path.isfile(root):
            yield root
            continue
        if not os.path.isdir(root):
            notes.append(f"{root}: no such file or directory")
            continue
        top = os.path.realpath(root)
        for d, dirs, files in os.walk(root):
            for name in sorted(dirs):
                p = os.path.join(d, name)
                if name.startswith(".") or name in SKIP_DIRS:
                    dirs.remove(name)
                elif os.path.islink(p):
                    dirs.remove(name)
                    notes.append(f"{p}: symlinked directory not followed")
            dirs.sort()
            for name in sorted(files):
                p = os.path.join(d, name)
                if not name.endswith(".py"):
                    continue
                real = os.path.realpath(p)
                if os.path.islink(p) and os.path.commonpath([top, real]) != top:
                    notes.append(f"{p}: symlink outside the tree not followed")
                elif os.path.isfile(real):
                    yield p


def read_source(path: str, notes: list[str]) -> bytes | None:
    """The file's bytes, or None (with a note) when it is huge, binary or unreadable."""
    try:
        if (size := os.path.getsize(path)) > MAX_BYTES:
            notes.append(f"{path}: skipped, {size / 2**20:.1f} MiB is over the {MAX_BYTES >> 20} MiB limit")
            return None
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        notes.append(f"{path}: unreadable ({e.strerror})")
        return None
    return data


FILE_TIMEOUT = 120.0  # seconds for one file: beyond the size guard, a last bound on the time a file can take


class FileTimeout(Exception):
    pass


@dataclass
class FileResult:
    findings: list[Finding]
    notes: list[str]
    error: bool = False  # the tool failed on this file (internal error, timeout, crashed worker): exit code 3


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `FileTimeout` after `seconds` (SIGALRM: only in a main thread, elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise FileTimeout
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def tool_error(path: str, what: str) -> Finding:
    return Finding(path, 1, 1, "NRN000", f"not analysed: {what}", "report")


def check_file(path: str) -> FileResult:
    """The findings of one file, and notes on why it was skipped."""
    notes: list[str] = []
    if (data := read_source(path, notes)) is None:
        return FileResult([], notes)
    try:
        with time_limit(FILE_TIMEOUT):
            return FileResult(analyze(data, path).findings, notes)
    except FileTimeout:
        return FileResult([tool_error(path, f"analysis took over {FILE_TIMEOUT:.0f} s")], notes, True)
    except Exception as e:  # a bug of ours must not stop the run: report the file and go on
        return FileResult([tool_error(path, f"internal error: {type(e).__name__}: {e}")], notes, True)


_STARTED: Any = None  # in a worker: the queue on which it announces each file before analysing it


def _start_worker(queue: Any) -> None:
    global _STARTED
    _STARTED = queue


def _check_in_worker(path: str) -> FileResult:
    _STARTED.put((os.getpid(), path))
    return check_file(path)


def map_files(fn: Callable[[str], Any], worker_fn: Callable[[str], Any], files: list[str], jobs: int,
              crashed: Callable[[str], Any]) -> list[Any]:
    """`fn` over `files`, in order, in `jobs` worker processes (0: one per CPU). A worker that dies (a signal
    inside a native parser) breaks the pool: the files it had started get `crashed(path)`, the rest are run
    again in a new pool."""
    if jobs == 1 or len(files) < 2:
        return list(map(fn, files))
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    results: dict[str, Any] = {}
    todo = list(files)
    while todo:
        queue, started = ctx.SimpleQueue(), {}  # pid -> the file that worker started last
        with ProcessPoolExecutor(jobs or None, mp_context=ctx, initializer=_start_worker,
                                 initargs=(queue,)) as pool:
            futures = {pool.submit(worker_fn, p): p for p in todo}
            broken = False
            for fut in as_completed(futures):
                _drain(queue, started)  # keep the pipe from filling up: a worker would block on it
                try:
                    results[futures[fut]] = fut.result()
                except BrokenProcessPool:
                    broken = True
        if not broken:
            break
        _drain(queue, started)
        live = {p.pid for p in multiprocessing.active_children()}
        for pid, p in started.items():
            if p not in results and pid not in live:
                results[p] = crashed(p)
        rest = [p for p in todo if p not in results]
        if len(rest) == len(todo):  # no progress and no culprit found: give up on these files, never loop
            results |= {p: crashed(p) for p in rest}
        todo = rest
    return [results[p] for p in files]


def _drain(queue: Any, started: dict[int, str]) -> None:
    while not queue.empty():
        pid, path = queue.get()
        started[pid] = path


def _crashed(path: str) -> FileResult:
    return FileResult([tool_error(path, "the checker's worker process crashed on this file")], [], True)


def check_paths(paths: Iterable[str], jobs: int = 1) -> Report:
    """Check every file under `paths`, in `jobs` processes (0: one per CPU), in a stable order."""
    rep, t0, c0 = Report(), time.perf_counter(), _cpu()
    files = list(iter_files(paths, rep.notes))
    for r in map_files(check_file, _check_in_worker, files, jobs, _crashed):
        rep.findings += r.findings
        rep.notes += r.notes
        rep.errors += r.error
    rep.files, rep.seconds, rep.cpu = len(files), time.perf_counter() - t0, _cpu() - c0
    return rep


def _cpu() -> float:
    """CPU seconds of this process and its finished workers."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run(paths: list[str], fmt: str = "text", jobs: int = 1, out: TextIO | None = None,
        err: TextIO | None = None) -> int:
    """`torchneuron check`: 1 when something is found, 0 when clean, 3 when the tool failed on a file."""
    out, err = out or sys.stdout, err or sys.stderr
    rep = check_paths(paths, jobs)
    for n in rep.notes:
        print(f"note: {n}", file=err)
    out.write(FORMATS[fmt](rep))
    if rep.errors:
        print(f"error: the checker failed on {rep.errors} file(s) (NRN000 'not analysed')", file=err)
    return TOOL_ERROR if rep.errors else 1 if rep.findings else 0


TOOL_ERROR = 3  # exit code: the tool itself failed on some file (2 is a usage error, 1 findings)

