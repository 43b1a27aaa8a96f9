"""The syntax-tree walk of `torchneuron check`: import resolution to qualified names, guard tracking
(`if torch.cuda.is_available():`), and the rule hits with the rewrite site of each auto finding."""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import libcst as cst

from .matcher import DEVICE_NAME, ArgPattern, Matcher, _value_ok, template
from .rules import VENDORS, Rule
from .syntax import _dotted, _is_none, _is_str, _kids, _names_in, _walk, literal

GUARDS = {"torch.cuda.is_available", "torch.accelerator.is_available"}
VENDOR_CHECK = re.compile(rf"(?:^|\.)(?:backends\.)?({'|'.join(VENDORS)})\.is_available$")


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
        self.device_vars: set[str] = set()  # targets whose CUDA string assignment is rewritten (NRN019)
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

    def visit_Comparison(self, node: cst.Comparison) -> None:
        """`"cuda" in device`, `device_type == "cuda"` against a variable whose `"cuda"` was rewritten: the literal
        is rewritten alike, so the test keeps its meaning (is it the device the script runs on?); left alone, it
        turned false on every other device (nanoGPT's `device_type` became "cpu": no autocast, no fused AdamW)."""
        if len(node.comparisons) != 1 or not isinstance(
                node.comparisons[0].operator, (cst.In, cst.NotIn, cst.Equal, cst.NotEqual)):
            return
        for lit_side, var_side in ((node.left, node.comparisons[0].comparator),
                                   (node.comparisons[0].comparator, node.left)):
            name, lit = _dotted(var_side), literal(lit_side)
            if name in self.device_vars and lit is not None and lit[0] == "cuda" and lit[1] is None:
                self.assigned[id(lit_side)] = name

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
        unguarded = (f"x.{method}(", f"if torch.accelerator.is_available(): x.{method}(")  # the guard only
        if method and (rule := self.m.methods.get(method)) and not self._module_receiver(node.func.value) and not (
                self.guard_depth and rule.replacement.startswith(unguarded)):  # guarded: the rewrite is a no-op
            guard_line = rule.replacement.startswith("if ") and not self.guard_depth  # replaces the statement
            site, why = self.site(rule, self.statements.get(id(node), node) if guard_line else node, node,
                                  subject="receiver")
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
            if site and rule in assigned:
                self.device_vars.add(target)
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
