"""The op table: everything torchneuron knows about each ATen op, as data, read by every layer.

The C++ core (which ops run natively, which keep float64 bits, which may take host index tensors), the compiler's
passes (engine counts, the float64 rule, random draws, what stays whole), the cost model (engine and cost rule)
and the profiler (engine rows) all ask `op_info`; no layer keeps an op set of its own. Keys are ATen base names
(`aten::add_.Tensor` -> `add`), or `base.overload` for the few facts that differ per overload.

An op missing from the table (DEFAULT) runs as a counted host fallback: engine "host", not native, not exact, not
random, no host tensors, costed by the `sweep` rule (one datapath pass per tensor input) at VectorE's rate, which is
what neuronx-cc would lower an unlisted elementwise op to. Every op torch marks as a view (`OpOverload.is_view`, aten
and prims) is listed as free, except `contiguous` (a copy when it is not a no-op).

Decisions where the layers used to disagree (Trainium semantics):
- `empty*`, `new_empty*`, `resize_`, `set_`: allocation is runtime bookkeeping, no engine or DMA runs -> free.
- `zeros`/`ones`/`full` (and `_like`, `new_*`), `scalar_tensor`: a memset, what `fill_`/`zero_` do -> vector.
- `_local_scalar_dense` (`.item()`): a device-to-host DMA of one element and a sync -> dma, native, costed as a copy.
- `_unsafe_view`, `lift_fresh`: metadata only -> free (the C++ list had `_unsafe_view` as a DMA copy).
- `masked_scatter`: indexing, on GpSimd like every other scatter (was vector in one table, gpsimd in the other).
- `slice_scatter`/`select_scatter`: contiguous writes -> dma, costed by the scatter rule (only the rows written).
- `equal`: reads both tensors and runs as a host fallback -> the default (the cost model had it free).
- explicit C++ kernels counted as executed (`cauchy_`, `geometric_`, `log_normal_`, the fused RNN cells,
  `_scaled_dot_product_attention_math`) are native (the compiler called them host).
- `addr`: its operands are inputs 1 and 2 for the tensor-parallel layout too (the trace assumed 0 and 1).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

# Where an op runs: TensorE (matmul/conv, the 128x128 systolic array), VectorE / ScalarE (elementwise,
# activations, reductions), GpSimd (indexing, gather/scatter, iota), DMA (data movement), free (metadata only,
# no engine), host (a host fallback on this device; costed at VectorE's rate).
ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma", "free", "host")


class Rule(Enum):
    """The cost model's rule for an op (costmodel/ops.py implements each)."""

    MATMUL = "matmul"  # TensorE tiles of a (batched) GEMM
    CONV = "conv"  # implicit GEMM
    ATTENTION = "attention"  # fused (flash) attention: two GEMMs per head, exp on ScalarE
    RNN = "rnn"  # a recurrent layer's whole sequence: per step a GEMM, then the gates, step after step
    SWEEP = "sweep"  # `passes` datapath sweeps over the largest tensor
    SORT = "sort"  # a sweep with log2(last dim) passes (sorting network, scan)
    GATHER = "gather"  # a lookup touching only the rows it returns
    SCATTER = "scatter"  # an update touching only the rows it writes
    COPY = "copy"  # bandwidth-bound data movement
    FREE = "free"  # costs nothing


@dataclass(frozen=True)
class Op:
    """One op. `native`: the device runs it (else a counted host fallback); `exact`: pure data movement that keeps
    every bit of a float64 tensor under the trainium dtype policy; `random`: a draw the compiler keeps whole (its
    decomposition would use Inductor's generator), "shape" if it reads only its arguments' metadata (made before
    the kernel), "values" otherwise; `host_tensors`: takes CPU index tensors alongside device ones; `passes`:
    sweeps of the SWEEP rule (None: one per tensor input); `operands`: the two GEMM inputs (MATMUL);
    `tp_linear`: how a tensor-parallel partial sum passes through it ("all": linear in every input, "one": in one
    input only, "into": in the values it writes into a zero or partial destination); `decompose`: False keeps it
    whole in compiled graphs; `eager`: runs as its device kernel between compiled kernels; `device_checked` (an
    overload row): ATen's composite for it refuses devices other than CPU/CUDA/XPU, so the C++ core routes it to
    the fallback, where the CPU's entry runs it on host aliases;
    `fuse`: adaptive eager fusion may put it in a fused kernel (compiler/eager_fusion.py): deterministic
    elementwise ops and the reductions/normalisations Inductor fuses well; never a random draw, a view, a copy, a
    matmul, indexing or anything data-dependent (those end a fused run); `one_kernel`: a list op (`_foreach_*`) the
    device runs as one kernel, as CUDA's multi-tensor kernels do: the C++ core routes it to the fallback, which runs
    ATen's list op on the host aliases, instead of its composite launching one device op per tensor; `indices`:
    its int64 results are positions in its arguments (max_pool's, argmax's, sort's indices), so the trainium int64
    rule need not look at their values while no argument is int64 or holds 2^31 elements (the op stays queued);
    `structured` (an overload row): ATen implements it as a structured kernel (native_functions.yaml's
    `structured_delegate`), so its functional and out= forms run one meta and one impl: a queued call runs the
    out= form straight into the memory its launch handed out, instead of copying a fresh result there;
    `int_errors`: on integer tensors it raises on a value (a zero divisor, a negative integer exponent), so it never
    joins a fused kernel there (a fused kernel cannot undo the stores it made before the error); `scalar_scales`:
    its last Scalar multiplies argument 1 (`add`'s alpha, `addcmul`'s value), so a list op's per-tensor form folds
    that scalar into a multiply first (compiler/eager_fusion.py); `host_copy`: a copy that may cross between the
    device and the host (the stream checker orders it as a sync of the host); `fast` (an overload row): it has an
    unboxed kernel in csrc/fastpath.cpp (tests/test_optable.py checks that file against these rows); `overwrites`:
    its in-place form writes every element of its argument and reads none (a memset), so it makes memory a failed
    kernel left uncomputed computed again."""

    name: str
    engine: str = "host"
    native: bool = False
    rule: Rule = Rule.SWEEP
    exact: bool = False
    random: str | None = None
    host_tensors: bool = False
    passes: float | None = None
    operands: tuple[int, int] = (0, 1)
    tp_linear: str | None = None
    decompose: bool = True
    eager: bool = False
    device_checked: bool = False
    fuse: bool = False
    one_kernel: bool = False
    indices: bool = False
    structured: bool = False
    int_errors: bool = False
    scalar_scales: bool = False
    host_copy: bool = False
    fast: bool = False
    overwrites: bool = False

    @property
    def recurrent(self) -> bool:
        """Runs a sequence step after step, each step's work split over the threads (the C++ core's thread rule)."""
        return self.rule is Rule.RNN


def _group(engine: str, names: str, **kw: Any) -> list[Op]:
    """Rows of one engine: native unless on the host; data movement and metadata are exact; costed as a copy on
    DMA, free when free, else a sweep."""
    kw = {"native": engine != "host", "exact": engine in ("dma", "free"),
          "rule": {"dma": Rule.COPY, "free": Rule.FREE}.get(engine, Rule.SWEEP)} | kw
    return [Op(n, engine, **kw) for n in names.split()]


_TABLE: list[Op] = [
    *_group("tensor", "mm bmm matmul linear mv dot vdot _scaled_mm", rule=Rule.MATMUL),
    *_group("tensor", "addmm addbmm baddbmm addmv", rule=Rule.MATMUL, operands=(1, 2)),
    *_group("host", "addr", rule=Rule.MATMUL, operands=(1, 2)),
    *_group("host", "_grouped_mm", rule=Rule.MATMUL),  # MoE experts: tokens grouped by expert x [E, K, N]
    *_group("tensor", "convolution convolution_backward _convolution", rule=Rule.CONV),
    *_group("tensor", "_scaled_dot_product_flash_attention_for_cpu "
            "_scaled_dot_product_flash_attention_for_cpu_backward _scaled_dot_product_attention_math",
            rule=Rule.ATTENTION),
    *_group("tensor", "_scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention_backward",
            rule=Rule.ATTENTION, eager=True),
    # nn.LSTM's sequence kernel, a layer and direction per call (csrc/rnn.cpp)
    *_group("tensor", "mkldnn_rnn_layer mkldnn_rnn_layer_backward", rule=Rule.RNN),
    # FlexAttention's higher-order ops (torch.nn.attention.flex_attention), run by their dense implementation
    *_group("tensor", "flex_attention flex_attention_backward", rule=Rule.ATTENTION, eager=True),
    *_group("host", "_scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_backward "
            "_scaled_dot_product_cudnn_attention _scaled_dot_product_cudnn_attention_backward",
            rule=Rule.ATTENTION),  # CUDA's kernels: priced when a caller names them
    *_group("vector", "add sub", tp_linear="all", fuse=True),
    *_group("vector", "neg", exact=True, tp_linear="all", fuse=True),
    *_group("vector", "mul div", tp_linear="one", fuse=True),
    *_group("vector", "abs maximum minimum clamp clamp_min clamp_max", exact=True, fuse=True),
    *_group("vector", "eq ne lt le gt ge amax amin", exact=True, fuse=True),
    *_group("vector", "max min argmax argmin", exact=True),
    *_group("vector", "fill zero", exact=True, overwrites=True),
    *_group("vector", "where", exact=True, passes=3, fuse=True),
    *_group("vector", "masked_fill", exact=True, passes=2, fuse=True),
    *_group("vector", "triu tril", exact=True),
    *_group("vector", "sum mean", tp_linear="all", fuse=True),
    *_group("vector", "sign sgn reciprocal pow sqrt rsqrt square logical_and logical_or logical_not logical_xor "
            "bitwise_and bitwise_or bitwise_xor bitwise_not floor ceil round trunc frac remainder fmod floor_divide "
            "isnan isinf isposinf isneginf isfinite nan_to_num threshold_backward all any linalg_vector_norm",
            fuse=True),
    *_group("vector", "prod norm mse_loss mse_loss_backward smooth_l1_loss smooth_l1_loss_backward l1_loss huber_loss "
            "huber_loss_backward binary_cross_entropy binary_cross_entropy_backward binary_cross_entropy_with_logits "
            "_amp_foreach_non_finite_check_and_unscale _amp_update_scale avg_pool2d avg_pool2d_backward "
            "max_pool2d_with_indices max_pool2d_with_indices_backward "
            "_adaptive_avg_pool2d _adaptive_avg_pool2d_backward adaptive_max_pool2d upsample_nearest2d "
            "upsample_bilinear2d upsample_nearest2d_backward upsample_bilinear2d_backward native_dropout_backward "
            "nll_loss2d_forward nll_loss2d_backward _thnn_fused_lstm_cell _thnn_fused_gru_cell "
            "_thnn_fused_lstm_cell_backward_impl _thnn_fused_gru_cell_backward"),
    *_group("vector", "addcmul addcdiv lerp", passes=3, fuse=True),
    *_group("vector", "_foreach_add _foreach_mul _foreach_div _foreach_sub _foreach_addcmul _foreach_addcdiv "
            "_foreach_lerp _foreach_sqrt _foreach_maximum _foreach_minimum _foreach_neg _foreach_abs _foreach_exp "
            "_foreach_reciprocal _foreach_sign _foreach_clamp_min _foreach_clamp_max", one_kernel=True, fuse=True),
    *_group("vector", "_foreach_norm _foreach_pow _foreach_zero", one_kernel=True),
    *_group("vector", "_softmax _log_softmax logsumexp native_layer_norm native_group_norm", passes=3, fuse=True),
    *_group("vector", "native_batch_norm _native_batch_norm_legit", passes=3),  # update running stats in place
    *_group("vector", "_softmax_backward_data _log_softmax_backward_data _fused_rms_norm var std var_mean std_mean",
            passes=2, fuse=True),
    *_group("vector", "_native_batch_norm_legit_no_training nll_loss_backward", passes=2),
    *_group("vector", "_fused_rms_norm_backward", passes=4),
    *_group("vector", "native_layer_norm_backward", passes=5, fuse=True),
    *_group("vector", "native_batch_norm_backward native_group_norm_backward", passes=5),
    *_group("vector", "nll_loss_forward", passes=1),
    *_group("vector", "_fused_adam _fused_adamw", passes=12),
    *_group("vector", "_fused_sgd", passes=4),
    *_group("vector", "cumsum cumprod", rule=Rule.SORT),
    *_group("host", "_safe_softmax", passes=3),  # decomposed on the device; priced when a trace records it
    *_group("vector", "zeros zeros_like ones ones_like full full_like new_zeros new_ones new_full scalar_tensor "
            "convert_element_type"),  # memsets (what fill_/zero_ run) and prims casts
    *_group("vector", "bernoulli normal native_dropout", random="values"),
    *_group("vector", "uniform random exponential cauchy geometric log_normal", random="shape"),
    *_group("vector", "bernoulli.p normal.float_float", random="shape"),  # no tensor values read
    *_group("scalar", "exp exp2 expm1 log log2 log10 log1p sigmoid sigmoid_backward tanh tanh_backward relu gelu "
            "silu mish mish_backward hardtanh hardtanh_backward hardsigmoid hardsigmoid_backward hardswish "
            "hardswish_backward leaky_relu leaky_relu_backward elu elu_backward softplus softplus_backward erf erfinv "
            "sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh logit xlogy glu glu_backward "
            "log_sigmoid_forward log_sigmoid_backward threshold", fuse=True),
    *_group("scalar", "gelu_backward silu_backward", passes=3, fuse=True),
    *_group("gpsimd", "index_select gather masked_select", rule=Rule.GATHER, exact=True, tp_linear="one"),
    *_group("gpsimd", "index", rule=Rule.GATHER, exact=True, host_tensors=True, tp_linear="one"),
    *_group("gpsimd", "embedding embedding_bag _embedding_bag", rule=Rule.GATHER),
    *_group("gpsimd", "scatter index_copy", rule=Rule.SCATTER, exact=True),
    *_group("gpsimd", "index_put _index_put_impl", rule=Rule.SCATTER, exact=True, host_tensors=True,
            tp_linear="into"),
    *_group("gpsimd", "index_add scatter_add", rule=Rule.SCATTER, tp_linear="into"),
    *_group("gpsimd", "index_fill scatter_reduce", rule=Rule.SCATTER),
    *_group("gpsimd", "masked_scatter", rule=Rule.SCATTER, exact=True, decompose=False),
    *_group("gpsimd", "sort topk", rule=Rule.SORT, exact=True),
    *_group("gpsimd", "argsort", rule=Rule.SORT),
    *_group("gpsimd", "nonzero stack flip roll repeat", exact=True),
    *_group("gpsimd", "embedding_dense_backward arange linspace one_hot bucketize searchsorted _embedding_bag_backward "
            "repeat_interleave _unique2 unique_dim iota"),
    *_group("gpsimd", "multinomial", random="values"),
    *_group("gpsimd", "randperm", random="shape"),
    *_group("host", "take", native=False, rule=Rule.GATHER),
    *_group("host", "rand randn randint rand_like randn_like randint_like normal_functional", native=False,
            random="shape"),
    *_group("host", "poisson", native=False, random="values"),
    *_group("host", "mode"),
    *_group("host", "mode.values", device_checked=True),  # "mode only supports CPU, CUDA and XPU" (docs/device.md)
    *_group("dma", "clone copy _to_copy cat", tp_linear="all"),
    *_group("dma", "contiguous constant_pad_nd reflection_pad2d replication_pad2d split_with_sizes_copy "
            "narrow_copy expand_copy permute_copy t_copy transpose_copy view_copy unsqueeze_copy squeeze_copy "
            "slice_copy select_copy as_strided_copy alias_copy diagonal_scatter as_strided_scatter _copy_from "
            "_copy_from_and_resize lift_fresh_copy"),
    *_group("dma", "slice_scatter select_scatter", rule=Rule.SCATTER),
    *_group("dma", "_local_scalar_dense", host_tensors=True),
    *_group("free", "record_stream"),  # the allocator's bookkeeping (which stream may still use a block)
    # questions answered from the tensors' metadata (`p.data = t` asks the first): no device work
    *_group("free", "_has_compatible_shallow_copy_type is_same_size _has_same_storage_numel is_set_to _is_zerotensor "
            "is_complex is_floating_point is_signed is_conj is_neg is_inference _nnz sparse_dim dense_dim"),
    *_group("free", "view _unsafe_view reshape expand permute t transpose squeeze unsqueeze slice select as_strided "
            "alias detach split split_with_sizes tensor_split unbind chunk diagonal narrow unfold _reshape_alias "
            "view_as_real view_as_complex conj real imag positive to pin_memory _nested_view_from_buffer lift_fresh "
            "_to_dense sym_size sym_stride sym_numel empty empty_like empty_strided new_empty new_empty_strided "
            "resize set _conj _neg_view resolve_conj resolve_neg adjoint broadcast_to expand_as flatten unflatten "
            "ravel reshape_as view_as movedim moveaxis swapaxes swapdims mT mH matrix_H numpy_T dsplit hsplit vsplit "
            "linalg_diagonal slice_inverse coalesce _autocast_to_full_precision _autocast_to_reduced_precision "
            "_fw_primal _make_dual _unpack_dual _indices _values indices values crow_indices col_indices ccol_indices "
            "row_indices _sparse_broadcast_to _nested_get_values _nested_view_from_jagged "
            "_test_autograd_multiple_dispatch_view broadcast_in_dim collapse_view split_dim view_of view_of_dtype"),
]


def base_name(op: Any) -> str:
    """`aten::add_.Tensor` (or its OpOverload) -> `add`: no namespace, no overload, no in-place underscore."""
    name = (op.name() if hasattr(op, "name") and callable(op.name) else str(op)).split("::")[-1].split(".")[0]
    return name[:-1] if len(name) > 1 and name.endswith("_") and not name.endswith("__") else name


def _merge(rows: list[Op]) -> dict[str, Op]:
    """One record per key. An overload row (`bernoulli.p`) refines its base's record with its `random` and
    `device_checked` fields only: the C++ core classifies by base name, so native, exact, engine and host tensors
    are per base name."""
    table: dict[str, Op] = {}
    for r in rows:
        assert r.name not in table, f"{r.name} is listed twice"
        assert r.engine in ENGINES and r.native == (r.engine != "host"), f"{r.name}: host iff not native"
        assert not (r.fuse and (r.random or not r.native)), f"{r.name}: only native, non-random ops fuse"
        base = r.name.split(".")[0]
        table[r.name] = (replace(table[base], name=r.name, random=r.random, device_checked=r.device_checked)
                         if base != r.name else r)
    return table


# Ops whose int64 results are indices into their arguments (`Op.indices`).
_INDICES = ("max_pool2d_with_indices adaptive_max_pool2d argmax argmin max min sort topk argsort searchsorted "
            "bucketize").split()
# Ops that raise on integer values (`Op.int_errors`): integer division and remainder by zero, negative integer powers.
_INT_ERRORS = "div remainder fmod floor_divide pow _foreach_div _foreach_pow".split()
# Functional overloads ATen implements as structured kernels (`Op.structured`): the queued ops whose results are
# not pointwise and large enough for the copy to show (matmuls, softmax, reductions, losses, pooling, indexing,
# concatenation).
_STRUCTURED = [n if "." in n else f"{n}.default" for n in (
    "mm bmm addmm baddbmm addmv _softmax _log_softmax _softmax_backward_data _log_softmax_backward_data "
    "sum.dim_IntList mean.dim amax amin prod.dim_int linalg_vector_norm nll_loss_forward nll_loss_backward cumsum "
    "avg_pool2d avg_pool2d_backward max_pool2d_with_indices max_pool2d_with_indices_backward upsample_nearest2d "
    "gather scatter_add argmax argmin topk cat").split()]
_SCALAR_SCALES = "add sub addcmul addcdiv".split()  # `Op.scalar_scales`
_HOST_COPIES = "_to_copy copy _copy_from _copy_from_and_resize".split()  # `Op.host_copy`
# The overloads csrc/fastpath.cpp has unboxed kernels for (`Op.fast`).
_FAST = ("add.Tensor sub.Tensor mul.Tensor div.Tensor div.Tensor_mode neg.default exp.default log.default "
         "sqrt.default rsqrt.default tanh.default sigmoid.default silu.default gelu.default maximum.default "
         "minimum.default pow.Tensor_Scalar pow.Tensor_Tensor gelu_backward.default tanh_backward.default "
         "sigmoid_backward.default silu_backward.default threshold_backward.default").split()
TABLE: dict[str, Op] = {k: replace(o, indices=b in _INDICES, int_errors=b in _INT_ERRORS,
                                   scalar_scales=b in _SCALAR_SCALES, host_copy=b in _HOST_COPIES)
                        for k, o in _merge(_TABLE).items() for b in [k.split(".")[0]]}
TABLE |= {n: replace(TABLE[n.split(".")[0]], name=n, structured=True) for n in _STRUCTURED}
TABLE |= {n: replace(TABLE.get(n) or TABLE[n.split(".")[0]], name=n, fast=True) for n in _FAST}
assert all(n in TABLE for n in _INDICES + _INT_ERRORS + _SCALAR_SCALES + _HOST_COPIES)
# An op missing from the table: a counted host fallback, priced as a VectorE sweep (see the module docstring).
DEFAULT = Op("", engine="host", native=False, rule=Rule.SWEEP)


def op_info(op: Any) -> Op:
    """The record of an op: an OpOverload, `aten::add_.Tensor`, `add.Tensor` or `add`. An overload row wins over its
    base name's; an op missing from the table gets DEFAULT (a host fallback), named after its base."""
    full = op.name() if hasattr(op, "name") and callable(op.name) else str(op)
    overload = getattr(op, "_overloadname", None)
    short = full.split("::")[-1]
    if overload is None and "." in short:
        overload = short.split(".", 1)[1]
    b = base_name(full)
    if overload and f"{b}.{overload}" in TABLE:
        return TABLE[f"{b}.{overload}"]
    return TABLE.get(b) or replace(DEFAULT, name=b)


def device_checked() -> list[str]:
    """The `name.overload`s the C++ core routes to the fallback because ATen's composite refuses the device."""
    return sorted(k for k, o in TABLE.items() if o.device_checked)


def structured() -> list[str]:
    """The `name.overload`s (`mm.default`) ATen implements as structured kernels."""
    return sorted(k for k, o in TABLE.items() if o.structured)


def names(field: str) -> list[str]:
    """Base names whose record has `field` set (the lists the C++ core receives: native, exact, host_tensors)."""
    return sorted(k for k, o in TABLE.items() if "." not in k and getattr(o, field))
