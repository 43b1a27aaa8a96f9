"""The op table (runtime/optable.py): every layer classifies each op as the table does, the default of an unlisted op
is the same everywhere, and the cross-layer check can fail."""
from __future__ import annotations

import ast
import re
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from op_consistency import disagreements

import torchneuron
from torchneuron import _C
from torchneuron.costmodel.ops import op_cost
from torchneuron.runtime.optable import DEFAULT, TABLE, Rule, base_name, device_checked, op_info, structured


def _aten_names() -> list[str]:
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(("aten::", "prims::")))


def test_the_table_and_a_sample_of_unlisted_ops_agree_across_layers():
    listed = [f"aten::{k}" for k in TABLE]
    unlisted = [n for n in _aten_names() if base_name(n) not in TABLE][::20]  # a spread of what nobody listed
    assert len(unlisted) > 50
    assert disagreements(dict.fromkeys([*listed, *unlisted, "aten::add_.Tensor", "prims::iota"])) == []


def test_every_view_torch_knows_is_free():
    """Views are metadata on every layer (the compiler used to ask `is_view`, the cost model a list of its own)."""
    not_free = set()
    for name in _aten_names():
        ns, _, rest = name.partition("::")
        packet, _, overload = rest.partition(".")
        op = getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")
        if op.is_view and op_info(op).engine != "free":
            not_free.add(base_name(name))
    assert not_free == {"contiguous"}  # a copy when it is not a no-op


def test_an_unlisted_op_is_a_host_fallback_priced_as_a_vector_sweep():
    info = op_info("aten::linalg_qr.default")
    assert info == replace(DEFAULT, name="linalg_qr")
    assert (info.engine, info.native, info.exact, info.random, info.host_tensors, info.rule) == \
        ("host", False, False, None, False, Rule.SWEEP)
    spec = [((256, 256), "float32")]
    host, vector = op_cost("linalg_qr", spec, spec, "trn2"), op_cost("sign", spec, spec, "trn2")  # one input each
    assert host.engine == "host" and vector.engine == "vector"
    assert host.compute_s == vector.compute_s and host.flops == 256 * 256  # one pass over the tensor


def test_device_checked_rows_name_real_overloads_routed_to_the_fallback():
    """The composites the C++ core routes to the fallback (ATen refuses the device in them) are real aten overloads,
    and nothing but an overload row can carry the flag (routing is per overload)."""
    assert device_checked(), "ATen 2.13 has device-checked composites (mode.values): the table must name them"
    for name in device_checked():
        base, overload = name.split(".")
        assert overload in getattr(torch.ops.aten, base).overloads()
    assert not any(o.device_checked for k, o in TABLE.items() if "." not in k)


def test_the_overload_rows_refine_only_the_random_draw():
    assert op_info("aten::bernoulli.p").random == "shape" and op_info("aten::bernoulli.Tensor").random == "values"
    assert op_info(torch.ops.aten.normal.float_float).random == "shape"
    assert op_info("aten::bernoulli.p").native == op_info("aten::bernoulli").native


def test_eager_counters_match_the_table():
    x = torch.randn(4, 4, device="neuron")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (x @ x).relu().sum().item()
        torch.equal(x, x)  # a host fallback
        torch.empty(3, device="neuron").log_normal_()  # an explicit C++ kernel, counted as executed
    executed = set(dict(_C._executed_ops()))
    fallback = set(dict(_C._fallback_ops()))
    assert {"aten::mm", "aten::log_normal_", "aten::_local_scalar_dense"} <= executed and "aten::equal" in fallback
    assert disagreements(dict.fromkeys(executed | fallback), executed, fallback) == []


def test_a_disagreement_is_reported():
    """The check is not vacuous: an op counted against its classification is named."""
    bad = disagreements({"aten::linalg_qr": None, "aten::mm": "vector"}, executed={"aten::linalg_qr"},
                        fallback={"aten::mm"})
    assert len(bad) == 3 and all(("linalg_qr" in b) != ("mm" in b.split(":")[2]) for b in bad)


@pytest.mark.skipif(not hasattr(_C, "_op_class"), reason="a C++ core built before the op-table bindings")
def test_the_cpp_core_reads_the_table_and_names_ops_like_python():
    for name in ("aten::add_.Tensor", "aten::__and__.Tensor", "aten::__iand__.Tensor", "aten::index_put_",
                 "aten::_local_scalar_dense", "aten::linalg_qr", "aten::masked_scatter_"):
        info = op_info(name)
        assert dict(_C._op_class(name)) == {"base": base_name(name), "native": info.native, "exact": info.exact,
                                            "host_tensors": info.host_tensors}, name
    assert torchneuron  # the device loaded the table at import


def test_structured_rows_are_structured_kernels_in_atens_own_definitions():
    """A queued call of a `structured` overload runs its out= form (no result copy), which is only the same kernel
    when ATen defines the overload as a structured delegate: checked against the native_functions.yaml shipped
    with torch (torchgen's copy); the flag is per overload (`mm.dtype` is not structured)."""
    import torchgen
    import yaml

    path = Path(torchgen.__file__).parent / "packaged/ATen/native/native_functions.yaml"
    delegates = {f["func"].split("(")[0] for f in yaml.safe_load(path.read_text()) if f.get("structured_delegate")}
    named = {n.removesuffix(".default") for n in structured()}  # the yaml names a default overload by its base
    assert named and named <= delegates, named - delegates
    assert op_info("aten::mm.default").structured and op_info("aten::sum.dim_IntList").structured
    assert not op_info("aten::mm.dtype").structured and not op_info("aten::sum.default").structured


# ---- the op table is the only list of ops ----------------------------------------------------------------------

ROOT = Path(torchneuron.__file__).parent
_QUALIFIED = re.compile(r'"aten::([A-Za-z0-9_]+)(\.[A-Za-z0-9_]+)?"')


def _prefix_literals(tree: ast.AST) -> set[int]:
    """ids of the string constants used as a prefix or suffix (`name.startswith("aten::_foreach_")`)."""
    return {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("startswith", "endswith", "removeprefix", "removesuffix") for a in n.args}


def _named_ops(path: Path) -> list[str]:
    """The `aten::name` literals a file holds (Python: string constants that are not a prefix; C++: string literals,
    except one assigned to a variable named `prefix`)."""
    if path.suffix == ".py":
        tree = ast.parse(path.read_text())
        skip = _prefix_literals(tree)
        return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and id(n) not in skip and _QUALIFIED.fullmatch(f'"{n.value}"')]
    return [m.group(0).strip('"') for line in path.read_text().splitlines() if "prefix =" not in line
            for m in _QUALIFIED.finditer(line)]


def _op_sets(path: Path) -> list[str]:
    """Module-level collections of op names outside the table (`_FOLD = ("add", "sub")`): two or more strings, each
    a qualified aten name or a base name the table lists."""
    found = []
    for node in ast.parse(path.read_text()).body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Dict):
            elts = value.keys
        elif isinstance(value, (ast.Tuple, ast.List, ast.Set)):
            elts = value.elts
        else:
            continue
        strings = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if len(strings) >= 2 and len(strings) == len(elts) and all(
                s.startswith("aten::") or base_name(s) in TABLE for s in strings):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_every_op_a_module_names_is_in_the_table_and_no_module_keeps_an_op_set_of_its_own():
    files = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".cpp", ".h") and p.name != "optable.py"]
    named = {(str(p.relative_to(ROOT)), n) for p in files for n in _named_ops(p)}
    assert len(named) > 40, "the scan sees the modules' op names"
    assert [(f, n) for f, n in sorted(named) if base_name(n) not in TABLE] == []
    assert [s for p in files if p.suffix == ".py" for s in _op_sets(p)] == []


def test_the_scan_sees_an_unknown_op_and_a_private_op_set(tmp_path, monkeypatch):
    f = tmp_path / "m.py"
    f.write_text('FOLD = ("add", "sub")\nOK = ("x", "add")\nname = "aten::warp_drive.default"\n'
                 'ours = name.startswith("aten::_foreach_")\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _named_ops(f) == ["aten::warp_drive.default"] and base_name("aten::warp_drive") not in TABLE
    assert [s.split(": ", 1)[1] for s in _op_sets(f)] == ["FOLD = ('add', 'sub')"]


def test_the_fast_rows_are_the_kernels_fastpath_cpp_registers():
    """csrc/fastpath.cpp binds an unboxed kernel per `FAST(id, "aten::name", "overload")`: exactly the table's `fast`
    overload rows, each a real overload."""
    text = (ROOT / "csrc" / "fastpath.cpp").read_text()
    registered = {f"{n}.{o or 'default'}" for n, o in re.findall(r'FAST\(\w+, "aten::(\w+)", "(\w*)"\)', text)}
    assert len(registered) >= 20
    assert registered == {k for k, o in TABLE.items() if o.fast}
    for k in registered:
        name, overload = k.split(".")
        assert getattr(getattr(torch.ops.aten, name), overload) is not None
