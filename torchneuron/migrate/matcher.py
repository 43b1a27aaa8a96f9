"""The rule table (rules.py) compiled into lookups: which rules a qualified name, a method or an argument
value can match, most specific first, and the parsed replacement of each auto rule."""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

import libcst as cst

from .rules import RULES, Rule
from .syntax import _is_none, literal

CUDA_SUBMODULES = ("memory", "random", "streams", "graphs", "amp.autocast_mode", "amp.grad_scaler")
SPECIFICITY = {"guarded": 0, "exact": 1, "method": 2, "prefix": 3, "any": 4}


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



DEVICE_NAME = re.compile(r"(?i)(^|[._])(\w*_)?(dev|device|devices|loc|map_location)(_\w*)?$")


def _value_ok(rule: Rule, node: cst.BaseExpression) -> bool:
    if rule.value is None:
        return True
    if rule.value == "[...]":
        return isinstance(node, (cst.List, cst.Tuple))
    if rule.value == "<index>":
        return isinstance(node, (cst.Name, cst.Attribute, cst.Integer, cst.Subscript)) and not _is_none(node)
    return (lit := literal(node)) is not None and re.fullmatch(rule.value, lit[0]) is not None
