"""libcst helpers for the checker and the fixer: fast child walks, dotted names, literal values and
source positions of chosen nodes."""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator

import libcst as cst
from libcst._nodes.internal import CodegenState


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



def _is_none(node: cst.CSTNode | None) -> bool:
    return isinstance(node, cst.Name) and node.value == "None"


def _is_str(node: cst.CSTNode | None) -> bool:
    return isinstance(node, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString))



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
