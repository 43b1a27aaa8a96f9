"""`torchneuron fix`: rewrite the `auto` findings of `check` into device-agnostic PyTorch, keeping everything else.

One `device = ...` with a CPU fallback is hoisted after the imports (under a free name) instead of inlining
long expressions; the result runs on CPU-only hosts with plain PyTorch. Unparsable files are never touched,
report-only findings are left alone, and a second run changes nothing.
"""
from __future__ import annotations

import ast
import contextlib
import difflib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import TextIO

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import RemoveImportsVisitor
from libcst.metadata import MetadataWrapper, ParentNodeProvider, ScopeProvider

from . import check
from .check import Analysis, analyze, iter_files, read_source
from .events import _event_uses, _Facts, _imported_module
from .findings import Finding
from .rules import BY_CODE
from .syntax import _dotted, _walk, literal
from .visitor import GUARDS, Imports, Site

HOIST = '{d} = {t}.accelerator.current_accelerator() if {t}.accelerator.is_available() else {t}.device("cpu")'
DEVICE_NAMES = ("device", "accel_device", "default_device", "torch_device")
SAFE_PARENTS = (cst.Arg, cst.Assign, cst.AnnAssign, cst.Return, cst.Expr, cst.Element, cst.DictElement,
                cst.FormattedStringExpression)  # where a conditional expression needs no parentheses
NO_SPACE = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))


@dataclass
class FixResult:
    path: str
    old: str
    new: str
    data: bytes | None = None  # the new file in its own encoding, when it changed
    applied: list[Finding] = field(default_factory=list)
    remaining: list[Finding] = field(default_factory=list)
    error: str | None = None
    tool_error: bool = False  # the tool failed (internal error, timeout), not the file


@dataclass
class Names:
    """How the rewritten code spells torch, torch.distributed and the hoisted device in this module."""
    torch: str = "torch"
    dist: str | None = None
    device: str = "device"
    hoist: bool = False  # the device line is still to be inserted

    def fill(self, text: str, index: bool) -> str:
        if index:  # the matched code named an index: keep it
            text = re.sub(r"(?<![.\w])device(?![.\w])", "torch.device(device.type, __index__)", text)
        text = re.sub(r"(?<![.\w])device(?!\w)", self.device, text)
        if self.dist:
            text = re.sub(r"(?<![.\w])torch\.distributed\.", self.dist + ".", text)
        return re.sub(r"(?<![.\w])torch(?=\.)", self.torch, text)


def _names(a: Analysis, facts: _Facts, sites: list[Site]) -> tuple[Names, bool] | None:
    """The spelling to use, and whether `import torch` must be added; None when `torch` means something else."""
    names = Names()
    torch = facts.aliases.get("torch")
    missing = torch is None or not facts.only_imports(torch, "torch")
    if missing and not facts.only_imports("torch", "torch"):
        return None
    names.torch = "torch" if missing else torch
    if (dist := facts.aliases.get("torch.distributed")) and facts.only_imports(dist, "torch.distributed"):
        names.dist = dist
    if any(_uses_device(s.rule.replacement) for s in sites):
        hoisted = [_code(s.body[0].targets[0].target) for s in a.module.body if _is_hoist(s, names.torch)]
        names.device = next(iter(hoisted), None) or _own_device(a.module, facts, sites) or ""
        if not names.device:
            names.hoist = True
            names.device = next(n for n in (*DEVICE_NAMES, *(f"device_{i}" for i in range(1, 100))) if facts.free(n))
    # functions that import torch themselves need no module-level import; the hoisted line does
    return names, missing and (names.hoist or not all(facts.sees(s.target, "torch") for s in sites))


def _own_device(module: cst.Module, facts: _Facts, sites: list[Site]) -> str | None:
    """The script's own `device = torch.device("cuda" if torch.cuda.is_available() else "cpu")` (or the
    conditional of two `torch.device`s): after the rewrite it equals the hoisted device, so reuse it when it
    is bound once, at module level, before any code that runs at import time uses it."""
    q = Imports(module).qualify
    call = lambda n, name: isinstance(n, cst.Call) and q(n.func) == {name}
    dev = lambda n, t: call(n, "torch.device") and len(n.args) == 1 and literal(n.args[0].value) == (t, None)
    guard = lambda n: isinstance(n, cst.Call) and not n.args and bool(q(n.func) & GUARDS)
    pick = lambda e: isinstance(e, cst.IfExp) and guard(e.test) and literal(e.body) == ("cuda", None) and \
        literal(e.orelse) == ("cpu", None)
    idiom = lambda v: (isinstance(v, cst.IfExp) and guard(v.test) and dev(v.body, "cuda") and dev(v.orelse, "cpu")) \
        or (call(v, "torch.device") and len(v.args) == 1 and pick(v.args[0].value))
    uses = {id(s.target) for s in sites if _uses_device(s.rule.replacement)}
    for stmt in module.body:
        if (isinstance(stmt, cst.SimpleStatementLine) and isinstance(asg := stmt.body[0], cst.Assign)
                and len(asg.targets) == 1 and isinstance(name := asg.targets[0].target, cst.Name)
                and idiom(asg.value) and facts.bound[name.value] == 1 and name.value not in facts.imports):
            return name.value
        if any(id(n) in uses for p in _executed(stmt) for n in _walk(p)):
            return None
    return None


def _uses_device(replacement: str) -> bool:
    return re.search(r"(?<![.\w])device(?!\w)", replacement) is not None


def _executed(stmt: cst.CSTNode) -> list[cst.CSTNode]:
    """The parts of a top-level statement that run at import time (a function's body runs later)."""
    return [*stmt.decorators, stmt.params] if isinstance(stmt, cst.FunctionDef) else [stmt]


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def _is_hoist(stmt: cst.CSTNode, torch: str) -> bool:
    if not (isinstance(stmt, cst.SimpleStatementLine) and isinstance(a := stmt.body[0], cst.Assign)
            and len(a.targets) == 1 and isinstance(t := a.targets[0].target, cst.Name)):
        return False
    return _code(a.value) == HOIST.format(d=t.value, t=torch).split(" = ", 1)[1]


# ---- templates --------------------------------------------------------------------------------------------------

class _Fill(cst.CSTTransformer):
    """Put the matched code into a parsed replacement: `x`, `__index__` and the `...` argument."""

    def __init__(self, subject: cst.BaseExpression | None, index: cst.BaseExpression | None,
                 args: list[cst.Arg] | None, func: cst.BaseExpression | None = None):
        super().__init__()
        self.subject, self.index, self.args, self.func = subject, index, args, func

    def leave_Name(self, orig: cst.Name, upd: cst.Name) -> cst.BaseExpression:
        return {"x": self.subject, "__index__": self.index, "__func__": self.func}.get(upd.value) or upd

    def leave_Call(self, orig: cst.Call, upd: cst.Call) -> cst.Call:
        i = next((i for i, a in enumerate(upd.args) if isinstance(a.value, cst.Ellipsis)), None)
        if i is None:
            return upd
        args = self.args or []
        new = [*upd.args[:i], *args, *upd.args[i + 1:]]
        for j, a in enumerate(new):  # commas between arguments; a trailing comma only if the user wrote it
            if j < len(new) - 1 and a.comma == cst.MaybeSentinel.DEFAULT:
                new[j] = a.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            elif j == len(new) - 1 and not i <= j < i + len(args):
                new[j] = a.with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return upd.with_changes(args=new)


def instantiate(site: Site, names: Names, subject: cst.BaseExpression | None, index: cst.BaseExpression | None,
                args: list[cst.Arg] | None, func: cst.BaseExpression | None = None) -> cst.CSTNode:
    indexed = index is not None and site.rule.indexed is not None
    text = names.fill(site.rule.indexed if indexed else site.rule.replacement, index is not None and not indexed)
    if site.quote != '"':  # inside a double-quoted f-string: the added strings take the other quote
        text = re.sub(r'"([^"\\]*)"', lambda m: site.quote + m[1] + site.quote, text)
    tpl = cst.parse_statement(text) if text.startswith("if ") else cst.parse_expression(text)
    if site.guarded and isinstance(tpl, cst.If) and "accelerator" in _code(tpl.test):  # already guarded: drop ours
        tpl = tpl.body.body[0].value
    elif site.guarded and isinstance(tpl, cst.IfExp) and "is_available" in _code(tpl.test):
        tpl = tpl.body
    return tpl.visit(_Fill(subject, index, args, func))


# ---- the rewrite ------------------------------------------------------------------------------------------------

class _Fixer(cst.CSTTransformer):
    def __init__(self, sites: dict[int, Site], names: Names, parents: dict[cst.CSTNode, cst.CSTNode]):
        super().__init__()
        self.sites, self.names, self.parents = sites, names, parents
        self.applied: set[int] = set()
        self.guards: set[int] = set()  # ids of the `if torch.accelerator.is_available():` statements written

    def on_leave(self, orig: cst.CSTNode, upd: cst.CSTNode) -> cst.CSTNode | cst.RemovalSentinel:
        upd = super().on_leave(orig, upd)
        if (site := self.sites.get(id(orig))) is None:
            return upd
        self.applied.add(id(orig))
        new = self.rewrite(site, orig, upd)
        if isinstance(new, cst.If):
            self.guards.add(id(new))
        return new

    def _merge(self, body: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """Adjacent guards this fix wrote (`if available: a` then `if available: b`) become one."""
        out: list[cst.BaseStatement] = []
        for stmt in body:
            prev = out[-1] if out else None
            if id(stmt) in self.guards and id(prev) in self.guards and not stmt.leading_lines:
                stmt = prev.with_changes(body=prev.body.with_changes(body=[*prev.body.body, *stmt.body.body]))
                self.guards.add(id(stmt))
                out.pop()
            out.append(stmt)
        return out

    def leave_IndentedBlock(self, orig: cst.IndentedBlock, upd: cst.IndentedBlock) -> cst.IndentedBlock:
        return upd.with_changes(body=self._merge(upd.body)) if self.guards else upd

    def leave_Module(self, orig: cst.Module, upd: cst.Module) -> cst.Module:
        return upd.with_changes(body=self._merge(upd.body)) if self.guards else upd

    def rewrite(self, site: Site, orig: cst.CSTNode, upd: cst.CSTNode) -> cst.CSTNode:
        if isinstance(upd, cst.SimpleStatementLine):  # `if available: call(...)` replaces the statement line
            call = upd.body[0].value
            new = self.expression(site, call, call)
            ws, header = upd.trailing_whitespace, cst.TrailingWhitespace()
            if site.rule.noqa:  # the rewrite must stay as written: exempt its lines from the rules it still matches
                ws = ws.with_changes(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(
                    f"# noqa: {site.rule.noqa}" + (f" {ws.comment.value.lstrip('#').strip()}" if ws.comment else "")))
                header = cst.TrailingWhitespace(cst.SimpleWhitespace("  "), cst.Comment(f"# noqa: {site.rule.noqa}"))
            inner = cst.SimpleStatementLine([cst.Expr(new.body.body[0].value)], trailing_whitespace=ws)
            return new.with_changes(body=cst.IndentedBlock([inner], header=header), leading_lines=upd.leading_lines)
        if site.rule.replacement == "":  # delete the argument
            return upd.with_changes(args=_drop(upd.args, site.drop))
        call = upd if isinstance(upd, cst.Call) else None
        new = self.expression(site, upd, call)
        if site.rule.code == "NRN001" and isinstance(new, cst.Call) and self.storage_receiver(orig):
            new = new.with_changes(args=[new.args[0].with_changes(keyword=cst.Name("device"), equal=NO_SPACE),
                                         *new.args[1:]])
        if isinstance(new, cst.IfExp):
            if orig.lpar:
                new = new.with_changes(lpar=orig.lpar, rpar=orig.rpar)
            elif not isinstance(self.parents.get(orig), SAFE_PARENTS):
                new = new.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        elif isinstance(upd, cst.BaseExpression) and upd.lpar and isinstance(new, cst.BaseExpression):
            new = new.with_changes(lpar=upd.lpar, rpar=upd.rpar)
        return new

    def storage_receiver(self, call: cst.CSTNode) -> bool:
        """`storage.cuda()` on a storage: `Storage.to` takes the device by keyword only. A receiver is a storage
        when it is the first parameter of a `map_location` function or the result of `.storage()` and kin."""
        recv = call.func.value if isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) else None
        if isinstance(recv, cst.Call) and isinstance(recv.func, cst.Attribute):
            return recv.func.attr.value in ("storage", "untyped_storage", "_typed_storage")
        if not isinstance(recv, cst.Name):
            return False
        node = call
        while (node := self.parents.get(node)) is not None:
            if isinstance(node, (cst.Lambda, cst.FunctionDef)):
                params = node.params.params
                if not params or params[0].name.value != recv.value:
                    return False
                arg = self.parents.get(node)
                return isinstance(node, cst.FunctionDef) or (
                    isinstance(arg, cst.Arg) and arg.keyword is not None and arg.keyword.value == "map_location")
        return False

    def expression(self, site: Site, upd: cst.CSTNode, call: cst.Call | None) -> cst.CSTNode:
        args, index = None, site.index
        if call is not None:
            args = [a.with_changes(keyword=cst.Name(k), equal=NO_SPACE) if k else a
                    for a, k in zip_longest(call.args, site.kw[:len(call.args)])]
            if site.drop is not None:
                index = call.args[site.drop].value if site.index_arg == site.drop else index
                args = _drop(args, site.drop)
        subject = {"value": upd, "receiver": call.func.value if call is not None and
                   isinstance(call.func, cst.Attribute) else None,
                   "arg0": call.args[0].value if call is not None and call.args else None}.get(site.subject)
        new = instantiate(site, self.names, subject, index, args, call.func if call is not None else None)
        root = new.body.body[0].value if isinstance(new, cst.If) else new
        if call is not None and isinstance(root, cst.Call):
            root2 = root.with_changes(whitespace_before_args=call.whitespace_before_args)
            if site.keep_func:
                root2 = root2.with_changes(func=call.func)
            new = root2 if root is new else new.deep_replace(root, root2)
        return new


def _drop(args: tuple[cst.Arg, ...], i: int) -> list[cst.Arg]:
    new = [a for j, a in enumerate(args) if j != i]
    if i == len(args) - 1 and new:  # the previous argument takes over the trailing comma (or none)
        new[-1] = new[-1].with_changes(comma=args[i].comma)
    return new


# ---- one file ---------------------------------------------------------------------------------------------------

def fix_source(source: bytes | str, path: str = "<string>") -> FixResult:
    """Rewrite the auto findings of `source`; never raises on bad input (see `FixResult.error`)."""
    a = analyze(source, path, keep_tree=True)
    old = a.module.code if a.module else (source if isinstance(source, str) else source.decode("utf-8", "replace"))
    res = FixResult(path, old, old, remaining=list(a.findings))
    if a.module is None:  # unparsable (reported), or nothing to find
        res.error = a.findings[0].message if a.findings else None
        return res
    todo = [f for f in a.findings if f.fix == "auto"]
    if not todo:
        return res
    wrapper = MetadataWrapper(a.module, unsafe_skip_copy=True)
    facts = _Facts.of(wrapper)
    picked = _names(a, facts, [f.site for f in todo])
    if picked is None:
        res.error = "`torch` names something other than the torch module here; not rewritten"
        return res
    names, add_torch = picked
    for f in todo:
        if shadow := next((n for n in (names.torch, names.dist) if n and facts.shadowed(f.site.target, n)), None):
            f.fix, f.message = "suggest", f"{f.message} [not rewritten: `{shadow}` is rebound here]"
    parents = wrapper.resolve(ParentNodeProvider)
    todo = [f for f in todo if f.fix == "auto"]
    events = _event_uses(a.module, facts, parents, [f for f in todo if f.code == "NRN041" and not f.site.guarded])
    used_imports = _cuda_imports(wrapper)

    def render(fixes: list[Finding]) -> tuple[cst.Module, _Fixer]:
        sites: dict[int, Site] = {}
        for f in fixes:
            sites.setdefault(id(f.site.target), f.site)
            for use in events.get(id(f.site.target)) or ():
                sites.setdefault(id(use.target), use)
        fixer = _Fixer(sites, names, parents)
        module = _remove_unused(a.module.visit(fixer), used_imports)
        return _hoist(module, names, add_torch), fixer

    want = grammars(old) or frozenset()
    module, fixer = render(todo)
    if (got := grammars(module.code)) is None or not want <= got:  # find the rewrites that break it, drop them
        for f in todo:
            alone = grammars(render([f])[0].code)
            if alone is None or not want <= alone:
                lost = ", ".join(sorted(want - (alone or frozenset()))) or "any"
                f.fix = "suggest"
                f.message += f" [not rewritten: the result would not parse under Python {lost}]"
        todo = [f for f in todo if f.fix == "auto"]
        module, fixer = render(todo)
        if (got := grammars(module.code)) is None or not want <= got:
            res.error = "the rewrites together would not parse under every Python grammar the file parses under"
            return res
    res.applied = [f for f in todo if id(f.site.target) in fixer.applied]
    res.remaining = [f for f in a.findings if f not in res.applied]
    lines = old.splitlines()

    def called(f: Finding) -> bool:  # `torch.cuda.Stream(...)` runs; an annotation or isinstance() target does not
        return re.match(r"[\w.]+\s*\(", lines[f.line - 1][f.col - 1:]) is not None if f.line <= len(lines) else False

    if res.applied and (stuck := [f for f in res.remaining if BY_CODE[f.code].raises_off_cuda and called(f)]):
        f = stuck[0]  # the rewritten file would still stop there on neuron and on CPU: better not touch it
        res.error = (f"line {f.line}: {f.code} {f.message.split(' [')[0]} cannot be rewritten here and raises on any "
                     "host without CUDA, so a partial rewrite would not run; rewrite it by hand, then run fix again")
        res.remaining, res.applied = list(a.findings), []
        return res
    res.new, res.data = module.code, module.bytes
    return res


GRAMMARS = ("3.10", "3.11", "3.12", "3.13")  # the Python versions the project supports


def grammars(code: str) -> frozenset[str] | None:
    """The supported Python versions whose grammar accepts `code`; None when libcst cannot parse it. 3.12 and
    3.13 (PEP 701 f-strings) are libcst's grammar; 3.10 and 3.11 are also checked by Python's own parser with
    `feature_version` and by the pre-3.12 f-string rules (no reused quote, backslash or comment inside)."""
    try:
        module = cst.parse_module(code)
    except Exception:
        return None
    ok = {"3.12", "3.13"}
    if sys.version_info >= (3, 12):
        try:
            ast.parse(code)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            ok.discard(f"3.{sys.version_info[1]}")
    if _old_fstrings(module):
        for minor in (10, 11):
            try:
                ast.parse(code, feature_version=(3, minor))
                ok.add(f"3.{minor}")
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                pass
    return frozenset(ok)


def _old_fstrings(module: cst.Module) -> bool:
    """Do the f-strings follow the rules before Python 3.12 (which Python >= 3.12's parser no longer checks)?"""
    for node in _walk(module):
        if isinstance(node, cst.FormattedString):
            for part in node.parts:
                if isinstance(part, cst.FormattedStringExpression):
                    text = module.code_for_node(part.expression)
                    if "\\" in text or "#" in text or (len(node.quote) == 1 and node.quote in text):
                        return False
    return True


def _cuda_imports(wrapper: MetadataWrapper) -> list[tuple[str, str | None, str | None]]:
    """Module-level `from torch.cuda... import x [as y]` and `import torch.cuda... as y` bindings in use before
    the rewrite: removed after it when the rewrite left them unused."""
    found = []
    g = next(s for s in wrapper.resolve(ScopeProvider).values() if s is not None).globals
    for asg in g.assignments:
        mod = _imported_module(asg.node, asg.name)
        if not asg.references or mod is None or not mod.startswith("torch.cuda"):
            continue
        if isinstance(asg.node, cst.ImportFrom):
            parent, obj = mod.rsplit(".", 1)
            found.append((parent, obj, None if asg.name == obj else asg.name))
        else:
            found.append((mod, None, asg.name))
    return found


def _remove_unused(module: cst.Module, imports: list[tuple[str, str | None, str | None]]) -> cst.Module:
    if not imports:
        return module
    ctx = CodemodContext()
    for mod, obj, asname in imports:
        RemoveImportsVisitor.remove_unused_import(ctx, mod, obj, asname)
    return RemoveImportsVisitor(ctx).transform_module(module)


def _hoist(module: cst.Module, names: Names, add_torch: bool) -> cst.Module:
    """Insert `import torch` and the device line once: after the imports, or before the first statement that
    runs at import time and uses the device."""
    if not names.hoist and not add_torch:
        return module
    body = list(module.body)
    imports = {i for i, s in enumerate(body) if isinstance(s, cst.SimpleStatementLine)
               and all(isinstance(b, (cst.Import, cst.ImportFrom)) for b in s.body)}
    binds = [i for i in sorted(imports) if not add_torch and names.torch in _bound(body[i])]
    pos = binds[0] + 1 if binds else int(bool(body) and _is_docstring(body[0]))
    while pos in imports:
        pos += 1
    if names.hoist:
        pos = min(pos, next((i for i, s in enumerate(body) if _executes_name(s, names.device)), pos))
    new: list[cst.BaseStatement] = []
    if add_torch or (binds and binds[0] >= pos):
        new.append(cst.parse_statement(f"import {names.torch}\n"))
    if names.hoist:
        new.append(cst.parse_statement(HOIST.format(d=names.device, t=names.torch) + "\n"))
    if pos > 0 and isinstance(body[pos - 1], cst.SimpleStatementLine):
        new[0] = new[0].with_changes(leading_lines=[cst.EmptyLine()])
    if pos < len(body) and not body[pos].leading_lines:  # and a blank line before the code that follows
        body[pos] = body[pos].with_changes(leading_lines=[cst.EmptyLine()])
    return module.with_changes(body=[*body[:pos], *new, *body[pos:]])


def _bound(stmt: cst.SimpleStatementLine) -> set[str]:
    out = set()
    for imp in stmt.body:
        if isinstance(imp, cst.Import):
            out |= {_dotted(al.asname.name) if al.asname else _dotted(al.name).split(".")[0] for al in imp.names}
        elif not isinstance(imp.names, cst.ImportStar):
            out |= {_dotted(al.asname.name if al.asname else al.name) for al in imp.names}
    return out


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr) and isinstance(
        stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))


def _is_future(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and isinstance(b := stmt.body[0], cst.ImportFrom) and \
        b.module is not None and _dotted(b.module) == "__future__"


def _executes_name(stmt: cst.CSTNode, name: str) -> bool:
    """Does running this top-level statement read `name`?"""
    return any(isinstance(n, cst.Name) and n.value == name for p in _executed(stmt) for n in _walk(p))


# ---- files ------------------------------------------------------------------------------------------------------

def fix_file(path: str, notes: list[str]) -> FixResult | None:
    if (data := read_source(path, notes)) is None:
        return None
    try:
        with check.time_limit(check.FILE_TIMEOUT):
            return fix_source(data, path)
    except check.FileTimeout:
        return FixResult(path, "", "", error=f"took over {check.FILE_TIMEOUT:.0f} s", tool_error=True)
    except Exception as e:  # a bug of ours must not stop the run, nor write anything
        return FixResult(path, "", "", error=f"internal error: {type(e).__name__}: {e}", tool_error=True)


def atomic_write(path: str, data: bytes) -> None:
    """Write through a temporary file in the same directory and `os.replace`: never a half-written file."""
    path = os.path.realpath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def diff(res: FixResult) -> str:
    return "".join(difflib.unified_diff(res.old.splitlines(keepends=True), res.new.splitlines(keepends=True),
                                        f"a/{res.path}", f"b/{res.path}"))


def run(paths: list[str], write: bool = False, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """`torchneuron fix`: print the diff (or write with `write`). 3 if the tool failed on a file; 1 if a file
    could not be rewritten or, without `write`, if anything would change; 0 otherwise."""
    out, err = out or sys.stdout, err or sys.stderr
    notes: list[str] = []
    changed = failed = applied = left = errors = 0
    for p in iter_files(paths, notes):
        if (res := fix_file(p, notes)) is None:
            continue
        if res.error:
            failed, errors = failed + 1, errors + res.tool_error
            print(f"{p}: not rewritten: {res.error}", file=err)
            continue
        left += sum(f.fix != "auto" for f in res.remaining)
        if res.new == res.old:
            continue
        if write:
            try:
                atomic_write(p, res.data)
            except OSError as e:
                failed += 1
                print(f"{p}: not written: {e}", file=err)
                continue
        else:
            out.write(diff(res))
        changed, applied = changed + 1, applied + len(res.applied)
    for n in notes:
        print(f"note: {n}", file=err)
    verb = "rewrote" if write else "would rewrite"
    print(f"{verb} {changed} files ({applied} fixes); {left} findings need a decision (torchneuron check)",
          file=err)
    return check.TOOL_ERROR if errors else 1 if failed or (changed and not write) else 0
