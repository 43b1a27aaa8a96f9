"""`torchneuron check`: find CUDA lock-in with libcst and qualified-name resolution, rule by rule from `rules.py`.

Static only: nothing here imports torch, so it runs fast, anywhere, and never needs a device.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import io
import json
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
from dataclasses import dataclass, field
from typing import Any, TextIO

import libcst as cst
from libcst._nodes.internal import CodegenState

from .rules import BENIGN, RULES, TRIGGER, VENDORS, Rule, shown

MAX_BYTES = 2 << 20  # larger files are generated or data, not code to migrate
SKIP_DIRS = {"__pycache__", "node_modules", "venv", "site-packages"}
GUARDS = {"torch.cuda.is_available", "torch.accelerator.is_available"}
CUDA_SUBMODULES = ("memory", "random", "streams", "graphs", "amp.autocast_mode", "amp.grad_scaler")
NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[,\s]+[A-Z]+[0-9]+)*))?", re.I)
VENDOR_CHECK = re.compile(rf"(?:^|\.)(?:backends\.)?({'|'.join(VENDORS)})\.is_available$")
SPECIFICITY = {"guarded": 0, "exact": 1, "method": 2, "prefix": 3, "any": 4}


@dataclass
class Finding:
    path: str
    line: int
    col: int  # 1-based, like ruff and SARIF
    code: str
    message: str
    fix: str  # auto | suggest | report: what `torchneuron fix` does with it here
    site: Site | None = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("path", "line", "col", "code", "message", "fix")}


@dataclass
class Site:
    """Where and how `fix` rewrites one auto finding; nodes are the original tree's, matched by identity."""
    rule: Rule
    target: cst.CSTNode  # the node the rewrite replaces
    call: cst.Call | None = None  # the call whose arguments `...` stands for
    subject: str = "none"  # what `x` is: value (the target), arg0 (the call's first argument), receiver
    kw: tuple[str | None, ...] = ()  # per original argument: the keyword it is passed as (params)
    drop: int | None = None  # argument position removed (index argument, or an empty replacement)
    index: cst.BaseExpression | None = None  # an index read from a string ("cuda:1" -> 1)
    index_arg: int | None = None  # ... or the position of the argument holding it
    guarded: bool = False  # already inside `if torch.{cuda,accelerator}.is_available():`
    keep_func: bool = False  # the replacement calls the same function: keep the user's spelling of it
    quote: str = '"'  # for the strings the rewrite adds: one an enclosing f-string does not use (before 3.12)


@dataclass
class Analysis:
    path: str
    findings: list[Finding]
    module: cst.Module | None = None


# ---- the rule table, compiled into lookups --------------------------------------------------------------------

@dataclass(frozen=True)
class ArgPattern:
    rule: Rule
    specs: tuple[tuple[bool, str, int | None], ...]  # (absent?, parameter, position)
    kind: str  # guarded | exact | method | prefix | any: the first is the most specific


class Matcher:
    def __init__(self, rules: list[Rule]):
        self.names: dict[str, Rule] = {}
        self.prefixes: list[tuple[str, Rule]] = []
        self.methods: dict[str, Rule] = {}
        self.attrs: dict[str, Rule] = {}
        self.imports: dict[str, Rule] = {}
        self.strings: list[Rule] = []
        self.guarded_strings: list[Rule] = []
        self.assigned_strings: list[Rule] = []
        self.args: dict[str, list[ArgPattern]] = {}  # key: qualified name, "prefix.*", ".method" or "*"
        self.ladder: Rule | None = None
        for rule in rules:
            for pat in rule.match:
                self._add(rule, pat)
        self.prefixes.sort(key=lambda p: -len(p[0]))
        self.roots = tuple({n.split(".")[0] + "." for n in [*self.names, *(p for p, _ in self.prefixes)]})
        self.arg_prefixes = [k[:-1] for k in self.args if k.endswith(".*")]

    def _add(self, rule: Rule, pat: str, guarded: bool = False) -> None:
        if pat.startswith("if torch.cuda.is_available(): "):
            return self._add(rule, pat.split(": ", 1)[1], guarded=True)
        if m := re.fullmatch(r"([\w.*]+)\((.*)\)", pat):
            callee, args = m.groups()
            if callee.startswith(".") and not args:
                self.methods[callee[1:]] = rule
                return
            specs = tuple((s.startswith("!"), *re.fullmatch(r"!?(\w+)(?:@(\d+)|=)", s).groups())
                          for s in (a.strip() for a in args.split(",")))
            specs = tuple((neg, name, None if pos is None else int(pos)) for neg, name, pos in specs)
            kind = "any" if callee == "*" else "method" if callee.startswith(".") else \
                "prefix" if callee.endswith(".*") else "exact"
            self.args.setdefault(callee, []).append(ArgPattern(rule, specs, "guarded" if guarded else kind))
        elif pat == "<assigned str>":
            self.assigned_strings.append(rule)
        elif pat == "<str>":
            (self.guarded_strings if guarded else self.strings).append(rule)
        elif pat == "<ladder>":
            self.ladder = rule
        elif pat.startswith("import "):
            self.imports[pat[7:]] = rule
        elif pat.startswith("."):
            self.attrs[pat[1:]] = rule
        elif pat.endswith(".*"):
            self.prefixes.append((pat[:-1], rule))
        elif pat != "<syntax error>":
            self.names[pat] = rule

    def name(self, qnames: Iterable[str]) -> Rule | None:
        """The rule for a reference to any of `qnames`: exact names first, then the longest prefix."""
        qnames = [n for q in qnames if q.startswith(self.roots) for n in (q, *_cuda_alias(q))]
        for q in qnames:
            if q in self.names:
                return self.names[q]
        return next((r for p, r in self.prefixes for q in qnames if q.startswith(p)), None)

    def arg_patterns(self, qnames: set[str], method: str | None) -> list[ArgPattern]:
        """The argument patterns for a call of `qnames` (or of `.method`), most specific first."""
        keys = [*qnames, "*", *([f".{method}"] if method else [])]
        keys += [k + "*" for k in self.arg_prefixes if any(q.startswith(k) for q in qnames)]
        return sorted((p for k in keys for p in self.args.get(k, ())), key=lambda p: SPECIFICITY[p.kind])

    def import_rule(self, module: str) -> Rule | None:
        return next((r for m, r in self.imports.items() if module == m or module.startswith(m + ".")), None)


def _cuda_alias(q: str) -> list[str]:
    """`torch.cuda.memory.memory_allocated` is also known as `torch.cuda.memory_allocated`."""
    return [f"torch.cuda.{q[len(p):]}" for s in CUDA_SUBMODULES if q.startswith(p := f"torch.cuda.{s}.")]


MATCHER = Matcher(RULES)


@functools.cache
def template(rule: Rule) -> cst.CSTNode | None:
    """The parsed replacement of an auto rule: an `if` statement, an expression, or None (delete the argument)."""
    if rule.fix != "auto" or not rule.replacement:
        return None
    return cst.parse_statement(rule.replacement) if rule.replacement.startswith("if ") else \
        cst.parse_expression(rule.replacement)


def _names_in(node: cst.CSTNode) -> set[str]:
    return {n.value for n in _walk(node) if isinstance(n, cst.Name)}


def _dotted(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    return f"{base}.{node.attr.value}" if isinstance(node, cst.Attribute) and (base := _dotted(node.value)) else None


# whitespace and punctuation: never part of a match, and most of the nodes
_SKIP = {"lpar", "rpar", "comma", "semicolon", "leading_lines", "trailing_whitespace", "header", "footer", "equal",
         "colon", "dot", "star", "lines_after_decorators", "leading_whitespace", "operator", "newline", "indent"}


@functools.cache
def _fields(t: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(t) if f.name not in _SKIP and not f.name.startswith("whitespace"))


def _kids(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """The child nodes that can hold code, without libcst's visitor (it rebuilds every node: 10x slower)."""
    for name in _fields(type(node)):
        v = getattr(node, name)
        if isinstance(v, cst.CSTNode):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (c for c in v if isinstance(c, cst.CSTNode))


def _walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    yield node
    for c in _kids(node):
        yield from _walk(c)


# ---- literals ---------------------------------------------------------------------------------------------------

def literal(node: cst.CSTNode) -> tuple[str, cst.BaseExpression | None] | None:
    """A string literal's text and the device index it carries: "cuda:1" -> 1, f"cuda:{r}", "cuda:{}".format(r),
    "cuda:%d" % r and "cuda:" + str(r) -> r (read as "cuda:{}"). None for anything else."""
    if isinstance(node, cst.SimpleString):
        try:
            v = node.evaluated_value
        except Exception:  # odd escapes: not a literal we reason about
            return None
        if not isinstance(v, str):
            return None
        m = re.fullmatch(r"cuda:(\d+)", v)
        return v, cst.Integer(m[1]) if m else None
    if isinstance(node, cst.FormattedString):
        exprs = [p.expression for p in node.parts if isinstance(p, cst.FormattedStringExpression)]
        text = "".join(p.value if isinstance(p, cst.FormattedStringText) else "{}" for p in node.parts)
        return text, exprs[0] if text == "cuda:{}" else None
    if isinstance(node, cst.BinaryOperation) and isinstance(node.left, cst.SimpleString) and \
            not _is_str(node.right) and (lit := literal(node.left)):
        if isinstance(node.operator, cst.Modulo) and not isinstance(node.right, (cst.Tuple, cst.Dict)) and \
                len(re.findall("%", lit[0])) == 1 and (text := re.sub(r"%[dis]", "{}", lit[0])) != lit[0]:
            return text, node.right if text == "cuda:{}" else None
        if isinstance(node.operator, cst.Add):
            arg = node.right.args[0].value if isinstance(node.right, cst.Call) and _dotted(node.right.func) == "str" \
                and len(node.right.args) == 1 and not node.right.args[0].keyword else None
            return lit[0] + "{}", arg if lit[0] == "cuda:" else None
        return None
    if (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "format"
            and isinstance(node.func.value, cst.SimpleString) and len(node.args) == 1 and not node.args[0].keyword
            and not node.args[0].star and (lit := literal(node.func.value)) and lit[0].count("{}") == 1):
        return lit[0], node.args[0].value if lit[0] == "cuda:{}" else None
    return None


DEVICE_NAME = re.compile(r"(?i)(^|[._])(\w*_)?(dev|device|devices|loc|map_location)(_\w*)?$")


def _value_ok(rule: Rule, node: cst.BaseExpression) -> bool:
    if rule.value is None:
        return True
    if rule.value == "[...]":
        return isinstance(node, (cst.List, cst.Tuple))
    if rule.value == "<index>":
        return isinstance(node, (cst.Name, cst.Attribute, cst.Integer, cst.Subscript)) and not _is_none(node)
    return (lit := literal(node)) is not None and re.fullmatch(rule.value, lit[0]) is not None


def _is_none(node: cst.CSTNode | None) -> bool:
    return isinstance(node, cst.Name) and node.value == "None"


def _is_str(node: cst.CSTNode | None) -> bool:
    return isinstance(node, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString))


# ---- the visitor ------------------------------------------------------------------------------------------------

class Imports:
    """Qualified names from the file's import bindings, wherever they are (`import torch.cuda as tc` makes
    `tc.synchronize` read `torch.cuda.synchronize`). Like libcst's QualifiedNameProvider for these names,
    without its full scope analysis, which took 60% of the run time: a local variable that shadows an
    import is the only difference, and a name imported in several places gets all of them."""

    def __init__(self, module: cst.Module):
        self.names: dict[str, set[str]] = {}
        self.modules: set[str] = set()  # names bound by a plain `import x`: modules, not objects
        self._collect(module)

    def _collect(self, node: cst.CSTNode) -> None:
        for c in _kids(node):
            if isinstance(c, cst.Import):
                for al in c.names:
                    full = _dotted(al.name)
                    name, target = (_dotted(al.asname.name), full) if al.asname else (full.split(".")[0],) * 2
                    self.names.setdefault(name, set()).add(target)
                    self.modules.add(name)
            elif isinstance(c, cst.ImportFrom):
                if c.module is not None and not c.relative and not isinstance(c.names, cst.ImportStar):
                    for al in c.names:
                        name = _dotted(al.asname.name if al.asname else al.name)
                        self.names.setdefault(name, set()).add(f"{_dotted(c.module)}.{_dotted(al.name)}")
            elif isinstance(c, STATEMENTS) and not isinstance(c, cst.BaseExpression):
                self._collect(c)

    def qualify(self, node: cst.CSTNode) -> set[str]:
        if (dotted := _dotted(node)) is None:
            return set()
        head, dot, rest = dotted.partition(".")
        return {q + dot + rest for q in self.names[head]} if head in self.names else {dotted}


@functools.cache
def _visit_fn(cls: type, t: type) -> Any:
    return getattr(cls, f"visit_{t.__name__}", None)


STATEMENTS = (cst.BaseStatement, cst.BaseSuite, cst.Else, cst.ExceptHandler, cst.ExceptStarHandler, cst.Finally,
              cst.MatchCase)


class _Visitor:
    """Pre-order walk calling `visit_<Node>` (False prunes); the body of an availability guard counts as guarded."""

    def __init__(self, m: Matcher, imports: Imports):
        self.m, self.imports = m, imports
        self.hits: list[tuple[Rule, cst.CSTNode, Site | None, str | None]] = []  # rule, node, site, why not
        self.claimed: set[int] = set()  # literals already matched by an argument pattern
        self.guard_depth = 0
        self.guard_bodies: dict[int, list[cst.CSTNode]] = {}  # id(is_available reference) -> what it guards
        self.calls: dict[int, cst.Call] = {}  # id(func) -> call
        self.statements: dict[int, cst.SimpleStatementLine] = {}  # id(call) -> its one-call statement line
        self.decorators: set[int] = set()
        self.with_items: set[int] = set()
        self.assigned: dict[int, str] = {}  # id(value of an assignment) -> its target, dotted
        self.elifs: set[int] = set()
        self.fquotes: list[str] = []  # the quotes of the single-quoted f-strings around the current node
        self.module: cst.Module | None = None

    def walk(self, node: cst.CSTNode) -> None:
        visit = _visit_fn(type(self), type(node))
        if visit is not None and visit(self, node) is False:
            return
        if isinstance(node, cst.FormattedString):
            self.fquotes.append(node.quote)
            for c in _kids(node):
                self.walk(c)
            self.fquotes.pop()
            return
        if isinstance(node, (cst.If, cst.IfExp)):
            self._guarded(node.test, node.body)
            if node.orelse is not None:
                self.walk(node.orelse)
            return
        if isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.And):  # `available() and ...`
            return self._guarded(node.left, node.right)
        for c in _kids(node):
            self.walk(c)

    def _guarded(self, test: cst.BaseExpression, body: cst.CSTNode) -> None:
        """Walk `test`, then `body`, which runs only when `test` holds."""
        self.walk(test)
        calls = self.guard_calls(test) or []
        for c in calls:
            self.guard_bodies.setdefault(id(c.func), []).append(body)
        self.guard_depth += bool(calls)
        self.walk(body)
        self.guard_depth -= bool(calls)

    # -- helpers
    def qnames(self, node: cst.CSTNode) -> set[str]:
        return self.imports.qualify(node)

    def guard_calls(self, test: cst.BaseExpression) -> list[cst.Call] | None:
        """The availability calls that make `test` an accelerator guard (`g()` or `... and g() and ...`)."""
        if isinstance(test, cst.Call) and self.qnames(test.func) & GUARDS:
            return [test]
        if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
            calls = [c for side in (test.left, test.right) for c in (self.guard_calls(side) or [])]
            return calls or None
        return None

    def hit(self, rule: Rule, node: cst.CSTNode, site: Site | None = None, why_not: str | None = None) -> None:
        self.hits.append((rule, node, site, why_not))

    def site(self, rule: Rule, target: cst.CSTNode, call: cst.Call | None = None,
             **kw: Any) -> tuple[Site | None, str | None]:
        """Build the rewrite of an auto rule, or say why it is not safe here."""
        if rule.fix != "auto":
            return None, None
        s = Site(rule, target, call, guarded=self.guard_depth > 0, **kw)
        if (quote := free_quote(self.fquotes, rule.replacement + (rule.indexed or ""))) is None:
            return None, NO_QUOTE
        s.quote = quote
        tpl = template(rule)
        if call is not None and isinstance(tpl, cst.Call):
            s.keep_func = _dotted(tpl.func) in self.qnames(call.func)
        if call is not None and (rule.params or rule.index):
            args = call.args
            if any(a.star for a in args):
                return None, "starred arguments"
            positional = [i for i, a in enumerate(args) if a.keyword is None]
            if len(positional) > len(rule.params) and rule.params:
                return None, "unexpected positional arguments"
            kw_of = {i: rule.params[n] for n, i in enumerate(positional) if rule.params}
            s.kw = tuple(kw_of.get(i) if a.keyword is None else None for i, a in enumerate(args))
            names = [kw_of.get(i) or (a.keyword.value if a.keyword else None) for i, a in enumerate(args)]
            if rule.index and rule.index in names:
                i = names.index(rule.index)
                if _is_str(args[i].value):
                    return None, "the device is given as a string"
                if not _is_none(args[i].value):
                    s.index_arg = i
                s.drop = i
        if isinstance(tpl, cst.If) and not s.guarded and id(call) not in self.statements:
            return None, "not a statement of its own"
        if tpl is not None and "x" in _names_in(tpl) and s.subject == "arg0" and (
                call is None or not call.args or call.args[0].keyword or _is_none(call.args[0].value)):
            return None, "no argument"
        if rule.only and not ONLY[rule.only][0](self, s):
            return None, ONLY[rule.only][1]
        return s, None

    # -- structure
    def visit_Module(self, node: cst.Module) -> None:
        self.module = node

    def visit_Assign(self, node: cst.Assign | cst.AnnAssign) -> None:
        targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
        if node.value is not None and len(targets) == 1 and (name := _dotted(targets[0])):
            self.assigned |= {id(b): name for b in _branches(node.value, self)}

    visit_AnnAssign = visit_Assign

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        if len(node.body) == 1 and isinstance(node.body[0], cst.Expr) and isinstance(node.body[0].value, cst.Call):
            self.statements[id(node.body[0].value)] = node

    def visit_Decorator(self, node: cst.Decorator) -> None:
        self.decorators.add(id(node.decorator))

    def visit_WithItem(self, node: cst.WithItem) -> None:
        self.with_items.add(id(node.item))

    def visit_If(self, node: cst.If | cst.IfExp) -> None:
        if isinstance(node.orelse, type(node)):
            self.elifs.add(id(node.orelse))
        if id(node) not in self.elifs:
            self._ladder(node)

    visit_IfExp = visit_If

    def _ladder(self, node: cst.CSTNode) -> None:
        tests, vendors = [], []
        while isinstance(node, (cst.If, cst.IfExp)):
            tests.append(node.test)
            node = node.orelse
        for t in tests:
            for n in _walk(t):
                if isinstance(n, cst.Call):
                    vendors += [m[1] for q in self.qnames(n.func) if (m := VENDOR_CHECK.search(q))]
        if self.m.ladder and "cuda" in vendors and len(set(vendors)) > 1:
            self.hit(self.m.ladder, tests[0])

    # -- imports
    def visit_Import(self, node: cst.Import) -> bool:
        for alias in node.names:
            if rule := self.m.import_rule(_dotted(alias.name)):
                self.hit(rule, alias)
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        if node.module and not node.relative and (rule := self.m.import_rule(_dotted(node.module))):
            self.hit(rule, node.module)
        return False

    # -- names, methods, attributes
    def visit_Attribute(self, node: cst.Attribute) -> bool:
        if _dotted(node) and (rule := self.m.name(self.qnames(node))):
            self._name_hit(rule, node)
            return False
        if rule := self.m.attrs.get(node.attr.value):
            self.hit(rule, node.attr)
        return True

    def visit_Name(self, node: cst.Name) -> None:
        if rule := self.m.name(self.qnames(node)):
            self._name_hit(rule, node)

    def _name_hit(self, rule: Rule, node: cst.CSTNode) -> None:
        call = self.calls.get(id(node))
        tpl = template(rule)
        if call is None and id(node) not in self.decorators:
            site, why = None, "not called" if rule.fix == "auto" else None
        elif call is None:
            site, why = self.site(rule, node)
        elif isinstance(tpl, cst.If) and not self.guard_depth:
            site, why = self.site(rule, self.statements.get(id(call), call), call, subject="arg0")
        else:
            site, why = self.site(rule, call, call, subject="arg0")
        self.hit(rule, node, site, why)

    # -- calls and their arguments
    def visit_Call(self, node: cst.Call) -> None:
        self.calls[id(node.func)] = node
        method = node.func.attr.value if isinstance(node.func, cst.Attribute) else None
        if method and (rule := self.m.methods.get(method)) and not self._module_receiver(node.func.value) and not (
                self.guard_depth and rule.replacement.startswith(f"x.{method}(")):  # guarded: the rewrite is a no-op
            site, why = self.site(rule, node, node, subject="receiver")
            self.hit(rule, node.func.attr, site, why)
        qnames = self.qnames(node.func) if isinstance(node.func, (cst.Name, cst.Attribute)) else set()
        if method and id(node) not in self.claimed and (lit := literal(node)):  # "cuda:{}".format(i) too
            self.claimed.add(id(node.func.value))
            self._string(node, lit)
        done: set[int] = set()
        for pat in self.m.arg_patterns(qnames, method):
            if pat.kind == "guarded" and not self.guard_depth:
                continue
            for value in self._arg_match(node, pat):
                key = id(value if value is not None else node)
                if key in done:
                    continue
                done.add(key)
                self._arg_hit(pat.rule, node, value)

    def _module_receiver(self, node: cst.BaseExpression) -> bool:
        """`tvm.cuda()` or `cupy.cuda` are other libraries' modules, not tensors."""
        return isinstance(node, cst.Name) and node.value in self.imports.modules

    def _arg_match(self, call: cst.Call, pat: ArgPattern) -> list[cst.BaseExpression | None]:
        """The subject values of `call` that satisfy `pat` ([None] for an absent-parameter match)."""
        found = []
        for absent, name, pos in pat.specs:
            arg = _find_arg(call, name, pos)
            if absent != (arg is None) or (arg is None and any(a.star for a in call.args)):
                return []
            found.append(arg)
        subject = found[0]
        if subject is None:
            return [None]
        literal_value = pat.rule.value not in (None, "[...]", "<index>")
        values = [v for v in (_branches(subject.value, self) if literal_value else [subject.value])
                  if _value_ok(pat.rule, v)]
        self.claimed |= {id(v) for v in values} | {id(v.func.value) for v in values if isinstance(v, cst.Call)}
        self.claimed |= {id(v.left) for v in values if isinstance(v, cst.BinaryOperation)}
        return values

    def _arg_hit(self, rule: Rule, call: cst.Call, value: cst.BaseExpression | None) -> None:
        if value is None:  # absent parameter: the call gains it
            site, why = self.site(rule, call, call)
            return self.hit(rule, call, site, why)
        lit = literal(value)
        index = lit[1] if lit else None
        if rule.replacement == "":
            i = next(i for i, a in enumerate(call.args) if a.value is value)
            site, why = self.site(rule, call, call)
            if site:
                site.drop = i
        elif rule.whole and any(a.value is value for a in call.args):
            site, why = self.site(rule, call, call, index=index)
        else:
            site, why = self.site(rule, value, None, subject="value", index=index)
        if site and index is not None and _is_str(index):
            site, why = None, "the index is a string"
        self.hit(rule, value, site, why)

    # -- strings
    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        if id(node) not in self.claimed and (lit := literal(node)):
            self._string(node, lit)

    def visit_FormattedString(self, node: cst.FormattedString) -> None:
        if id(node) not in self.claimed and (lit := literal(node)):
            self._string(node, lit)

    def _string(self, node: cst.BaseExpression, lit: tuple[str, cst.BaseExpression | None]) -> None:
        target = self.assigned.get(id(node))
        assigned = self.m.assigned_strings if target and (lit[1] is not None or DEVICE_NAME.search(target)) else []
        rules = (self.m.guarded_strings if self.guard_depth else []) + assigned + self.m.strings
        if rule := next((r for r in rules if re.fullmatch(r.value, lit[0])), None):
            self.claimed.add(id(node))
            site, why = self.site(rule, node, None, subject="value", index=lit[1])
            if site and "{}" in lit[0] and lit[1] is None:
                site, why = None, "the index is not a number (`str(i)` or a number is)"
            self.hit(rule, node, site, why)

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
        if id(node) not in self.claimed and (lit := literal(node)):
            self.claimed.add(id(node.left))
            self._string(node, lit)


NO_QUOTE = "inside f-strings that use both quote characters, the strings of the rewrite would end them before " \
    "Python 3.12"


def free_quote(fquotes: Iterable[str], replacement: str) -> str | None:
    """The quote for the strings a rewrite adds inside f-strings quoted with `fquotes`: before Python 3.12 an
    expression in a single-quoted f-string cannot use its quote. None when both are taken."""
    taken = {q for q in fquotes if len(q) == 1}
    if '"' not in replacement or '"' not in taken:
        return '"'
    return "'" if "'" not in taken else None


def _find_arg(call: cst.Call, name: str, pos: int | None) -> cst.Arg | None:
    for a in call.args:
        if a.keyword is not None and a.keyword.value == name:
            return a
    positional = [a for a in call.args if a.keyword is None and not a.star]
    return positional[pos] if pos is not None and pos < len(positional) else None


def _branches(node: cst.BaseExpression, v: _Visitor) -> list[cst.BaseExpression]:
    """A value and, through conditional expressions, its alternatives; a guarded branch is left to NRN003/NRN008."""
    if isinstance(node, cst.IfExp):
        body = [] if v.guard_calls(node.test) else _branches(node.body, v)
        return body + _branches(node.orelse, v)
    return [node]


# named conditions for `Rule.only`: when the rewrite keeps the program's meaning, and what to say otherwise
ONLY: dict[str, tuple[Any, str]] = {
    "int_arg": (lambda v, s: bool(s.call.args) and not _is_str(a := s.call.args[0].value) and not (
        isinstance(a, cst.Call) and v.qnames(a.func) & {"torch.device"} and any(_is_str(b.value) for b in a.args)),
        "the device names CUDA (a string or `torch.device(\"cuda\", ...)`)"),
    "no_device": (lambda v, s: all(_is_none(a.value) for k, a in zip(s.kw, s.call.args, strict=True)
                                   if (k or (a.keyword and a.keyword.value)) == "device"), "it names a CUDA device"),
    "with_item": (lambda v, s: id(s.call) in v.with_items and len(s.call.args) == 1,
                  "not a `with torch.cuda.stream(s):` item"),
    "no_keyword": (lambda v, s: all(a.keyword is None and not _is_str(a.value) for a in s.call.args),
                   "a keyword or string argument (the replacement takes a device index or `torch.device`)"),
    "no_args": (lambda v, s: not s.call.args, "arguments"),
    "one_arg": (lambda v, s: len(s.call.args) == 1 and s.call.args[0].keyword is None and not s.call.args[0].star,
                "arguments besides the message"),
}


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
        from .fix import downgrade_escaping_events  # fix imports this module; only files with events pay for it
        downgrade_escaping_events(module, findings)
    if noqa:
        findings = suppress(findings, re.split(r"\r\n|\r|\n", text))
    findings.sort(key=lambda f: (f.line, f.col, f.code))
    if not keep_tree:  # sites hold the tree: let it go
        for f in findings:
            f.site = None
        return Analysis(path, findings)
    return Analysis(path, findings, module)


class _Positions(CodegenState):
    """Where given nodes start and end (line, column): one code generation pass that only counts, instead of
    PositionProvider's, which records every node and took half of the run time."""

    def __init__(self, module: cst.Module, nodes: list[cst.CSTNode]):
        super().__init__(default_indent=module.default_indent, default_newline=module.default_newline)
        self.wanted = {id(n) for n in nodes}
        self.line, self.col = 1, 0
        self.start: dict[int, tuple[int, int]] = {}
        self.end: dict[int, tuple[int, int]] = {}
        module._codegen(self)

    def add_token(self, value: str) -> None:
        if (i := value.rfind("\n")) >= 0:
            self.line, self.col = self.line + value.count("\n"), len(value) - i - 1
        else:
            self.col += len(value)

    def add_indent_tokens(self) -> None:
        for t in self.indent_tokens:
            self.add_token(t)

    def before_codegen(self, node: cst.CSTNode) -> None:
        if id(node) in self.wanted:
            self.start[id(node)] = (self.line, self.col)

    def after_codegen(self, node: cst.CSTNode) -> None:
        if id(node) in self.wanted:
            self.end[id(node)] = (self.line, self.col)

    def pop_trailing_newline(self) -> None:
        pass


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

@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # skipped paths, with why
    files: int = 0
    seconds: float = 0.0  # wall clock
    cpu: float = 0.0  # CPU time (workers included): the rate that does not depend on the machine's load
    errors: int = 0  # files the tool failed on (each also an NRN000 finding)


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


# ---- output -----------------------------------------------------------------------------------------------------

def format_text(rep: Report) -> str:
    lines = [f"{f.path}:{f.line}:{f.col}: {f.code} [{f.fix}] {f.message}" for f in rep.findings]
    kinds = {k: sum(f.fix == k for f in rep.findings) for k in ("auto", "suggest", "report")}
    rate = lambda t: f"{rep.files / t:.1f}" if t else "-"
    lines.append(f"{len(rep.findings)} findings ({', '.join(f'{n} {k}' for k, n in kinds.items())}) in "
                 f"{rep.files} files, {rep.seconds:.2f}s ({rate(rep.seconds)} files/s; "
                 f"CPU {rep.cpu:.2f}s, {rate(rep.cpu)} files/s)")
    return "\n".join(lines) + "\n"


def format_json(rep: Report) -> str:
    return json.dumps([f.as_dict() for f in rep.findings], indent=1) + "\n"


def format_sarif(rep: Report) -> str:
    """SARIF 2.1.0, as GitHub code scanning reads it."""
    index = {r.code: i for i, r in enumerate(RULES)}
    level = {"auto": "warning", "suggest": "warning", "report": "note"}
    rules = [{"id": r.code, "name": r.category, "shortDescription": {"text": r.message},
              "fullDescription": {"text": r.why}, "help": {"text": f"Replacement: {r.replacement or '(remove)'}"},
              "properties": {"fix": r.fix, "category": r.category}} for r in RULES]
    results = [{"ruleId": f.code, "ruleIndex": index[f.code], "level": "error" if f.code == "NRN000" else level[f.fix],
                "message": {"text": f.message},
                "locations": [{"physicalLocation": {"artifactLocation": {"uri": f.path.replace(os.sep, "/")},
                                                    "region": {"startLine": f.line, "startColumn": f.col}}}],
                "properties": {"fix": f.fix}} for f in rep.findings]
    notes = [{"level": "note", "message": {"text": n}} for n in rep.notes]
    run = {"tool": {"driver": {"name": "torchneuron", "informationUri": "https://github.com/torchneuron/torchneuron",
                               "rules": rules}},
           "results": results,
           "invocations": [{"executionSuccessful": not rep.errors, "toolExecutionNotifications": notes}]}
    return json.dumps({"$schema": "https://json.schemastore.org/sarif-2.1.0.json", "version": "2.1.0",
                       "runs": [run]}, indent=1) + "\n"


FORMATS = {"text": format_text, "json": format_json, "sarif": format_sarif}


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
