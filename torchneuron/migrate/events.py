"""What `check` and `fix` both learn from a module's tree: who binds and reads which names (`_Facts`), and which
`torch.cuda.Event` uses can be guarded for CPU-only hosts (`downgrade_escaping_events`, `_event_uses`). Both
import this module; it imports neither."""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import MetadataWrapper, ParentNodeProvider, Scope, ScopeProvider

from .findings import Finding
from .rules import Rule
from .syntax import _dotted
from .visitor import GUARDS, Imports, Site, free_quote

# ---- module facts -----------------------------------------------------------------------------------------------

@dataclass
class _Facts:
    """Who binds and reads which names, in every scope of the module."""
    scopes: Mapping[cst.CSTNode, Scope | None]
    imports: dict[str, set[str]] = field(default_factory=dict)  # name -> the modules it is imported as
    bound: Counter[str] = field(default_factory=Counter)  # name -> bindings that are not imports
    local: dict[str, set[int]] = field(default_factory=dict)  # name -> ids of the function/class scopes binding it
    reads: set[str] = field(default_factory=set)
    aliases: dict[str, str] = field(default_factory=dict)  # module -> its module-level name

    @classmethod
    def of(cls, wrapper: MetadataWrapper) -> _Facts:
        f = cls(wrapper.resolve(ScopeProvider))
        for s in {id(s): s for s in f.scopes.values() if s is not None}.values():
            for asg in s.assignments:
                if (mod := _imported_module(asg.node, asg.name)) is None:
                    f.bound[asg.name] += 1
                    if s is not s.globals:
                        f.local.setdefault(asg.name, set()).add(id(s))
                    continue
                f.imports.setdefault(asg.name, set()).add(mod)
                if s is s.globals:
                    f.aliases.setdefault(mod, asg.name)
            f.reads |= {n.split(".")[0] for acc in s.accesses if (n := _dotted(acc.node))}
        return f

    def only_imports(self, name: str, mod: str) -> bool:
        """`name` is the module `mod` at module level (functions that rebind it are `shadowed`)."""
        return self.imports.get(name, {mod}) == {mod} and self.bound[name] == len(self.local.get(name, ()))

    def sees(self, node: cst.CSTNode, name: str) -> bool:
        """Is `name` bound where `node` is (for `torch`: by an import, `only_imports` made sure)?"""
        return (s := self.scopes.get(node)) is not None and name in s

    def shadowed(self, node: cst.CSTNode, name: str) -> bool:
        """Is `name` rebound in a function or class around `node` (`def f(torch): ...`)?"""
        s = self.scopes.get(node)
        while s is not None and s is not s.globals:
            if id(s) in self.local.get(name, ()):
                return True
            s = s.parent
        return False

    def free(self, name: str) -> bool:
        return name not in self.imports and not self.bound[name] and name not in self.reads


def _imported_module(node: cst.CSTNode, name: str) -> str | None:
    """The module an import statement binds to `name` (`import a.b` binds `a`; `import a.b as c` binds a.b)."""
    if isinstance(node, cst.Import):
        for al in node.names:
            full = _dotted(al.name)
            if al.asname and _dotted(al.asname.name) == name:
                return full
            if not al.asname and full.split(".")[0] == name:
                return name
    if isinstance(node, cst.ImportFrom) and node.module and not node.relative and \
            not isinstance(node.names, cst.ImportStar):
        for al in node.names:
            if _dotted(al.asname.name if al.asname else al.name) == name:
                return f"{_dotted(node.module)}.{_dotted(al.name)}"
    return None


# ---- timing events ----------------------------------------------------------------------------------------------

# The CPU has no events (`torch.Event(...).record()` raises there), so an unguarded `torch.cuda.Event` becomes a
# `torch.Event` whose uses are guarded: recording and waiting are skipped and times read NaN on CPU-only hosts.
EVENT_GUARDS = {  # method -> how a use is guarded ("if": the statement; else the default of a conditional)
    "record": "if", "synchronize": "if", "wait": "if", "elapsed_time": 'float("nan")', "query": "True"}
EVENT_ESCAPES = "the event is used beyond record/synchronize/wait/elapsed_time/query, which a CPU-only host " \
    "cannot run; guard its uses with `torch.accelerator.is_available()`"


# An event whose uses cannot be guarded (stored on an object, passed on) is, when made without arguments, the
# device module's event: on CPU-only hosts torch.cpu.Event, whose record/wait/synchronize/query do nothing.
ESCAPING_EVENT = Rule("NRN041", "sync", (), "", "torch.get_device_module(device).Event()", "auto",
                      "torch.cpu.Event takes no arguments", "")


def downgrade_escaping_events(module: cst.Module, findings: list[Finding]) -> None:
    """`check` and `fix` agree: an unguarded event whose uses cannot all be guarded becomes the device module's
    event when made without arguments, else a suggestion."""
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    found = [f for f in findings if f.code == "NRN041" and f.fix == "auto" and not f.site.guarded]
    events = _event_uses(module, _Facts.of(wrapper), wrapper.resolve(ParentNodeProvider), found)
    for f in found:
        if events[id(f.site.target)] is not None:
            continue
        if f.site.call is not None and not f.site.call.args:
            f.site = dataclasses.replace(f.site, rule=ESCAPING_EVENT)
            f.message = f"`torch.cuda.Event` is CUDA-only; use `{ESCAPING_EVENT.replacement}`"
        else:
            f.fix, f.message = "suggest", f"{f.message} [not rewritten: {EVENT_ESCAPES}]"


def _event_rule(method: str) -> Rule:
    guard = EVENT_GUARDS[method]
    text = f"if torch.accelerator.is_available(): x.{method}(...)" if guard == "if" else \
        f"x.{method}(...) if torch.accelerator.is_available() else {guard}"
    return Rule("NRN041", "sync", (), "", text, "auto", "CPU-only hosts have no events", "")


def _event_uses(module: cst.Module, facts: _Facts, parents: Mapping[cst.CSTNode, cst.CSTNode],
                found: list[Finding]) -> dict[int, list[Site] | None]:
    """For each unguarded event construction: the guarded rewrites of its uses, or None when the event escapes
    (bound to anything but plain names, rebound to something else, or used in another way)."""
    q = Imports(module).qualify
    targets: dict[int, cst.Name | None] = {id(f.site.target): _bound_name(f.site.target, parents) for f in found}
    event_names = {id(n) for n in targets.values() if n is not None}
    out: dict[int, list[Site] | None] = {}
    for key, name in targets.items():
        scope = facts.scopes.get(name) if name is not None else None
        if scope is None or any(id(asg.node) not in event_names for asg in scope.assignments[name.value]):
            out[key] = None
            continue
        uses: list[Site] | None = []
        event_refs = {id(r) for r in _refs(scope, event_names)}  # every read of an event in this scope
        for ref in {id(r.node): r.node for asg in scope.assignments[name.value] for r in asg.references}.values():
            use = _event_use(ref, parents, q, event_refs)
            if use is None:
                uses = None
                break
            if use is not True:
                uses.append(use)
        out[key] = uses
    return out


def _refs(scope: Scope, names: set[int]) -> list[cst.CSTNode]:
    return [r.node for asg in scope.assignments if id(asg.node) in names for r in asg.references]


def _bound_name(call: cst.CSTNode, parents: Mapping[cst.CSTNode, cst.CSTNode]) -> cst.Name | None:
    """The name `x = call` or `x, y = call, other` binds the call's value to."""
    parent = parents.get(call)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
        t = parent.targets[0].target
        return t if isinstance(t, cst.Name) else None
    tup = parents.get(parent) if isinstance(parent, cst.Element) else None
    asg = parents.get(tup) if isinstance(tup, cst.Tuple) else None
    if isinstance(asg, cst.Assign) and asg.value is tup and len(asg.targets) == 1 and \
            isinstance(t := asg.targets[0].target, (cst.Tuple, cst.List)) and len(t.elements) == len(tup.elements):
        el = t.elements[tup.elements.index(parent)]
        return el.value if isinstance(el.value, cst.Name) and not isinstance(el, cst.StarredElement) else None
    return None


def _event_use(ref: cst.CSTNode, parents: Mapping[cst.CSTNode, cst.CSTNode], q, event_refs: set[int]
               ) -> Site | bool | None:
    """The guarded rewrite of one use of an event; True when it needs none; None when it cannot be guarded."""
    attr = arg = parents.get(ref)
    if isinstance(arg, cst.Arg) and isinstance(call := parents.get(arg), cst.Call) and \
            isinstance(call.func, cst.Attribute) and call.func.attr.value == "elapsed_time" and id(ref) in event_refs:
        return True  # `start.elapsed_time(end)`: guarded with `start`
    call = parents.get(attr)
    if not (isinstance(attr, cst.Attribute) and attr.value is ref and isinstance(call, cst.Call)
            and call.func is attr and attr.attr.value in EVENT_GUARDS):
        return None
    if _under_guard(call, parents, q):
        return True
    rule = _event_rule(attr.attr.value)
    if EVENT_GUARDS[attr.attr.value] != "if":
        quotes = [n.quote for n in _ancestors(call, parents) if isinstance(n, cst.FormattedString)]
        if (quote := free_quote(quotes, rule.replacement)) is None:
            return None
        return Site(rule, call, call, subject="receiver", keep_func=True, quote=quote)
    line = parents.get(expr := parents.get(call))
    if not (isinstance(expr, cst.Expr) and isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1):
        return None
    return Site(rule, line, call, subject="receiver", keep_func=True)


def _ancestors(node: cst.CSTNode, parents: Mapping[cst.CSTNode, cst.CSTNode]) -> Iterator[cst.CSTNode]:
    while (node := parents.get(node)) is not None:
        yield node


def _under_guard(node: cst.CSTNode, parents: Mapping[cst.CSTNode, cst.CSTNode], q) -> bool:
    """Is `node` in the body of an `if`/conditional expression on accelerator availability?"""
    def guard(test):
        return (isinstance(test, cst.Call) and bool(q(test.func) & GUARDS)) or (
            isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And)
            and (guard(test.left) or guard(test.right)))
    while (parent := parents.get(node)) is not None:
        if isinstance(parent, (cst.If, cst.IfExp)) and parent.body is node and guard(parent.test):
            return True
        node = parent
    return False
