"""Runs PyTorch's OpInfo samples on `neuron` against CPU, the way PyTorch's test_compare_cpu does.

Samples are made on the device; each is copied to the CPU and the op runs on both. A sample is random when it
runs a random ATen op on neuron (tagged nondeterministic_seeded): the neuron generator is counter-based (Philox,
like CUDA's) and draws other numbers than the CPU's mt19937, so for those the neuron result must have the CPU
result's structure (shapes, dtypes) and be reproducible: the same seed gives the same result, bit for bit
(forward and gradients).
"""
from __future__ import annotations

import itertools
import re
import unittest

import pytest
import torch
from helpers import to_cpu, to_cpu_tree
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import DecorateInfo

import torchneuron


def op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


OPS = {op_id(op): op for op in op_db}


def pytorch_skips_compare_cpu(op, test_name: str = "test_compare_cpu") -> bool:
    """OpInfo entries PyTorch excludes from its own `test_name` (on some device)."""
    return any(isinstance(d, DecorateInfo) and d.test_name == test_name and
               any(getattr(x, "__name__", "") in ("skip", "decorator") or x is unittest.expectedFailure
                   for x in d.decorators)
               for d in op.decorators)


def seeded_call(op, sample, seed: int = 1234):
    torch.manual_seed(seed)  # seeds the CPU and every neuron generator alike
    return sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs))


def _seeded_op(name: str) -> bool:
    packet = getattr(torch.ops.aten, name.split("::")[-1], None)
    return packet is not None and any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags
                                      for o in packet.overloads())


def is_random(op, sample) -> bool:
    """Whether the op ran a random ATen op on neuron (OpInfo's wrappers reseed and restore the state themselves)."""
    torchneuron.clear_op_tracking()
    seeded_call(op, sample)
    ran = {**torchneuron.get_executed_ops(), **torchneuron.get_fallback_ops()}
    return any(_seeded_op(name) for name in ran)


def _same_structure(dev, ref, where: str) -> None:
    a, b = torch.utils._pytree.tree_flatten(dev)[0], torch.utils._pytree.tree_flatten(ref)[0]
    assert len(a) == len(b), f"{where}: {len(a)} outputs, the CPU gives {len(b)}"
    for x, y in zip(a, b, strict=True):
        if isinstance(y, torch.Tensor):
            assert (x.shape, x.dtype) == (y.shape, y.dtype), f"{where}: {x.shape} {x.dtype} vs CPU {y.shape} {y.dtype}"


def compare_forward(op, dtype: torch.dtype, atol: float, rtol: float) -> int:
    """Compare every sample; return how many were compared. Raises AssertionError on the first mismatch."""
    n = 0
    for sample in op.sample_inputs("neuron", dtype, requires_grad=False):
        cpu_sample = sample.transform(to_cpu)
        dev, ref = seeded_call(op, sample), seeded_call(op, cpu_sample)
        if is_random(op, sample):
            _same_structure(to_cpu_tree(dev), ref, f"{op_id(op)} sample {n}")
            ref = to_cpu_tree(seeded_call(op, sample))
            atol = rtol = 0
        torch.testing.assert_close(to_cpu_tree(dev), ref, atol=atol, rtol=rtol, equal_nan=True,
                                   check_device=False, msg=lambda m, n=n: f"{op_id(op)} sample {n}: {m}")
        n += 1
    return n


def _grad_inputs(sample):
    ts = [sample.input] + list(sample.args) + list(sample.kwargs.values())
    out = []
    for t in ts:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            out.append(t)
        elif isinstance(t, (list, tuple)):
            out.extend(x for x in t if isinstance(x, torch.Tensor) and x.requires_grad)
    return out


def _sum_outputs(out):
    if isinstance(out, torch.Tensor):
        return out.sum() if out.is_floating_point() or out.is_complex() else None
    parts = [_sum_outputs(o) for o in (out if isinstance(out, (list, tuple)) else [])]
    parts = [p for p in parts if p is not None and p.requires_grad]
    return sum(parts) if parts else None


def compare_backward(op, dtype: torch.dtype, atol: float, rtol: float) -> int:
    """Gradients of sum(outputs) for the first sample that has a gradient to compare; returns how many gradients
    were compared, 0 if no sample has one (no differentiable output, or no input the CPU's gradient reaches)."""
    for sample in op.sample_inputs("neuron", dtype, requires_grad=True):
        cpu_sample = sample.transform(to_cpu)
        try:  # samples whose gradient the CPU itself cannot take (e.g. complex32 sums) test nothing
            cpu_out = seeded_call(op, cpu_sample)
            cl, ci = _sum_outputs(cpu_out), _grad_inputs(cpu_sample)
            if cl is None or not ci:
                continue
            cl = cl.abs() if cl.is_complex() else cl
            cg = torch.autograd.grad(cl, ci, allow_unused=True)
        except (RuntimeError, NotImplementedError):
            continue
        def dev_grads(sample=sample):
            dl, di = _sum_outputs(seeded_call(op, sample)), _grad_inputs(sample)
            dl = dl.abs() if dl.is_complex() else dl
            return torch.autograd.grad(dl, di, allow_unused=True)
        dg = dev_grads()
        if all(g is None for g in (*dg, *cg)):  # no input reached on either device: nothing to compare here
            continue
        if is_random(op, sample):  # reproducible on neuron (see the module docstring)
            _same_structure([a.cpu() if a is not None else a for a in dg], list(cg), f"{op_id(op)} backward")
            cg, atol, rtol = [a.cpu() if a is not None else a for a in dev_grads()], 0, 0
        compared = 0
        for a, b in zip(dg, cg, strict=True):
            if a is None or b is None:
                assert a is None and b is None, f"{op_id(op)}: gradient defined on one device only"
                continue
            torch.testing.assert_close(a.cpu(), b, atol=atol, rtol=rtol, equal_nan=True,
                                       msg=lambda m: f"{op_id(op)} backward: {m}")
            compared += 1
        return compared
    return 0


# ---- the deeper checks: other dtypes, non-contiguous samples, out= and in-place variants, error inputs ----

def first_samples(op, dtype: torch.dtype, n: int):
    return list(itertools.islice(op.sample_inputs("neuron", dtype, requires_grad=False), n))


def compare_samples(op, dtype: torch.dtype, n: int, atol: float, rtol: float, noncontiguous: bool = False) -> int:
    """compare_forward on the first `n` samples, optionally with every tensor made non-contiguous on both devices."""
    done = 0
    for sample in first_samples(op, dtype, n):
        cpu_sample = on_cpu(sample)
        if noncontiguous:
            sample, cpu_sample = sample.noncontiguous(), cpu_sample.noncontiguous()
            try:
                ref = seeded_call(op, cpu_sample)
            except RuntimeError as e:  # kernels that require contiguous inputs: neuron must refuse them too
                with pytest.raises(type(e)):
                    seeded_call(op, sample)
                done += 1
                continue
        else:
            ref = seeded_call(op, cpu_sample)
        dev = seeded_call(op, sample)
        exact = is_random(op, sample)
        if exact:  # Philox draws: the CPU's structure, and reproducible bit for bit (module docstring)
            _same_structure(to_cpu_tree(dev), ref, f"{op_id(op)} {dtype} sample {done}")
            ref = to_cpu_tree(seeded_call(op, sample))
        torch.testing.assert_close(to_cpu_tree(dev), ref, atol=0 if exact else atol, rtol=0 if exact else rtol,
                                   equal_nan=True, check_device=False,
                                   msg=lambda m, d=done: f"{op_id(op)} {dtype} sample {d}: {m}")
        done += 1
    return done


def on_cpu(sample):
    """The sample with its tensors and any device arguments (factory ops' device="neuron") moved to the CPU."""
    cpu = sample.transform(to_cpu)
    cpu.kwargs = {k: to_cpu(v) for k, v in cpu.kwargs.items()}
    return cpu


def _raw_call(fn, sample, seed: int = 1234, **kwargs):
    torch.manual_seed(seed)
    return fn(sample.input, *sample.args, **sample.kwargs, **kwargs)


def _empty_out(like, device: str, shaped: bool):
    """out= arguments for a result: correctly shaped ones, or empty ones the op must resize."""
    if isinstance(like, torch.Tensor):
        return torch.empty(like.shape if shaped else (0,), dtype=like.dtype, device=device)
    if isinstance(like, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in like):
        return tuple(_empty_out(t, device, shaped) for t in like)
    return None


def compare_out(op, dtype: torch.dtype, n: int, atol: float, rtol: float) -> int:
    """op(..., out=...) on neuron writes what the CPU writes, into the given tensors (shaped, then empty)."""
    done = 0
    for sample in first_samples(op, dtype, n):
        cpu_sample = on_cpu(sample)
        try:
            expected = _raw_call(op, cpu_sample)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            continue  # the CPU cannot run this sample either
        for shaped in (True, False):
            cpu_out, dev_out = _empty_out(expected, "cpu", shaped), _empty_out(expected, "neuron", shaped)
            if cpu_out is None:
                return done
            _raw_call(op, cpu_sample, out=cpu_out)
            if is_random(op, sample):  # Philox draws: the reference is a second neuron run (module docstring)
                _same_structure(to_cpu_tree(dev_out), cpu_out, f"{op_id(op)} out=")
                cpu_out = _empty_out(expected, "neuron", shaped)
                _raw_call(op, sample, out=cpu_out)
                cpu_out = to_cpu_tree(cpu_out)
            res = _raw_call(op, sample, out=dev_out)
            if isinstance(dev_out, torch.Tensor):
                assert res is dev_out, f"{op_id(op)}: out= returned a different tensor than the one passed"
            torch.testing.assert_close(to_cpu_tree(dev_out), cpu_out, atol=atol, rtol=rtol, equal_nan=True,
                                       check_device=False,
                                       msg=lambda m, s=shaped: f"{op_id(op)} out= (shaped={s}): {m}")
        done += 1
    return done


def compare_inplace(op, dtype: torch.dtype, n: int, atol: float, rtol: float) -> int:
    """The in-place variant leaves the input as on the CPU, or raises the CPU's exception type."""
    inplace = op.get_inplace()
    done = 0
    for sample in first_samples(op, dtype, n):
        if not isinstance(sample.input, torch.Tensor):
            continue
        cpu_sample = on_cpu(sample)
        try:
            _raw_call(inplace, cpu_sample)
            cpu_error = None
        except Exception as e:  # noqa: BLE001 - compared with the device's exception below
            cpu_error = e
        if cpu_error is not None:
            try:
                _raw_call(inplace, sample)
            except Exception as e:  # noqa: BLE001
                assert isinstance(e, type(cpu_error)), f"{op_id(op)} in-place: CPU raised {cpu_error!r}, neuron {e!r}"
            else:
                raise AssertionError(f"{op_id(op)} in-place: CPU raised {cpu_error!r}, neuron did not")
            done += 1
            continue
        if is_random(op, sample):  # Philox draws: the reference is the same in-place call on a copy, on neuron
            cpu_sample.input = sample.input.clone()
            _raw_call(inplace, cpu_sample)
        res = _raw_call(inplace, sample)
        assert res is sample.input, f"{op_id(op)}: the in-place variant returned a different tensor"
        torch.testing.assert_close(sample.input.cpu(), to_cpu_tree(cpu_sample.input), atol=atol, rtol=rtol,
                                   equal_nan=True, msg=lambda m: f"{op_id(op)} in-place: {m}")
        done += 1
    return done


def _error_key(ei) -> tuple:
    """What identifies one error entry across devices: its declared error and the shapes, dtypes and other values of
    its sample (the device a tensor was made on left out)."""
    def leaf(x):
        if isinstance(x, torch.Tensor):
            return tuple(x.shape), x.dtype
        if isinstance(x, (str, torch.device)) and str(x).split(":")[0] in ("cpu", "neuron"):
            return "device"
        return repr(x)
    si = ei.sample_input
    return ei.error_type, ei.error_regex, tuple(map(leaf, torch.utils._pytree.tree_leaves((si.input, si.args,
                                                                                          si.kwargs))))


def check_error_inputs(op) -> int:
    """Every declared error input raises the declared exception type and message on neuron (the entries made for a
    non-CPU device declare CUDA's). An entry the CPU also has (same declared error and sample) is checked only when
    the CPU rejects it too; entries made only for a non-CPU device (mixed devices, CUDA's own checks) are checked on
    neuron alone. Entries are made on each device alike, so aliasing (overlap) is kept."""
    cpu_entries: dict[tuple, list] = {}
    for cpu_ei in op.error_inputs("cpu"):
        cpu_entries.setdefault(_error_key(cpu_ei), []).append(cpu_ei)
    done = 0
    for ei in op.error_inputs("neuron"):
        same = cpu_entries.get(_error_key(ei))
        if same:
            try:
                _raw_call(op, same.pop(0).sample_input)
            except Exception:  # noqa: BLE001
                pass
            else:
                continue  # entries that raise only on some other device (the CPU accepts them too)
        try:
            _raw_call(op, ei.sample_input)
        except Exception as e:  # noqa: BLE001
            assert isinstance(e, ei.error_type), f"{op_id(op)}: expected {ei.error_type.__name__}, got {e!r}"
            assert re.search(ei.error_regex, str(e)), f"{op_id(op)}: message {str(e)!r} !~ {ei.error_regex!r}"
        else:
            raise AssertionError(f"{op_id(op)}: expected {ei.error_type.__name__} ({ei.error_regex!r}), no error")
        done += 1
    return done
