"""The op set the modelled NeuronCore runs natively, as data. Everything else runs as a counted host fallback.

Names are ATen base names (no namespace, no overload, no trailing in-place underscore). Each group says which
engine would run it on Trainium; the cost model and the compiler read the same table.
"""
from __future__ import annotations

# engine -> ops. TensorE: matmul/conv on the 128x128 systolic array; VectorE/ScalarE: elementwise, activations,
# reductions; GpSimd: indexing, gather/scatter, iota; DMA: data movement.
NATIVE_OPS: dict[str, tuple[str, ...]] = {
    "tensor": (
        "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "mv", "dot", "vdot", "matmul", "linear",
        "convolution", "convolution_backward", "_convolution", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward", "_scaled_mm",
    ),
    "vector": (
        "add", "sub", "mul", "div", "neg", "abs", "sign", "sgn", "reciprocal", "pow", "sqrt", "rsqrt", "square",
        "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "where", "lerp", "addcmul", "addcdiv",
        "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
        "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "floor", "ceil", "round", "trunc", "frac",
        "remainder", "fmod", "floor_divide", "masked_fill", "isnan", "isinf", "isfinite", "nan_to_num",
        "sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std", "var_mean",
        "std_mean", "norm", "linalg_vector_norm", "cumsum", "cumprod", "logsumexp", "all", "any", "fill",
        "zero", "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
        "native_layer_norm", "native_layer_norm_backward", "native_batch_norm", "native_batch_norm_backward",
        "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "native_group_norm",
        "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
        "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward", "mse_loss",
        "mse_loss_backward", "smooth_l1_loss", "smooth_l1_loss_backward", "l1_loss", "huber_loss",
        "huber_loss_backward", "binary_cross_entropy", "binary_cross_entropy_backward",
        "binary_cross_entropy_with_logits", "threshold_backward", "bernoulli", "uniform", "normal",
        "random", "exponential", "_foreach_add", "_foreach_mul", "_foreach_div", "_foreach_sub",
        "_foreach_addcmul", "_foreach_addcdiv", "_foreach_lerp", "_foreach_sqrt", "_foreach_norm",
        "_foreach_maximum", "_foreach_neg", "_fused_adam", "_fused_adamw", "_fused_sgd",
        "_amp_foreach_non_finite_check_and_unscale", "_amp_update_scale", "avg_pool2d", "avg_pool2d_backward",
        "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "_adaptive_avg_pool2d",
        "_adaptive_avg_pool2d_backward", "adaptive_max_pool2d", "upsample_nearest2d", "upsample_bilinear2d",
        "upsample_nearest2d_backward", "upsample_bilinear2d_backward", "_local_scalar_dense", "native_dropout",
        "native_dropout_backward", "triu", "tril", "masked_scatter",
    ),
    "scalar": (
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sigmoid", "sigmoid_backward", "tanh",
        "tanh_backward", "relu", "gelu", "gelu_backward", "silu", "silu_backward", "mish", "mish_backward",
        "hardtanh", "hardtanh_backward", "hardsigmoid", "hardsigmoid_backward", "hardswish",
        "hardswish_backward", "leaky_relu", "leaky_relu_backward", "elu", "elu_backward", "softplus",
        "softplus_backward", "erf", "erfinv", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh",
        "cosh", "asinh", "acosh", "atanh", "logit", "xlogy", "glu", "glu_backward", "log_sigmoid_forward",
        "log_sigmoid_backward", "threshold",
    ),
    "gpsimd": (
        "index", "index_put", "_index_put_impl", "index_select", "index_add", "index_copy", "index_fill",
        "gather", "scatter", "scatter_add", "scatter_reduce", "embedding", "embedding_dense_backward",
        "arange", "linspace", "masked_select", "nonzero", "topk", "sort", "argsort", "one_hot", "bucketize",
        "searchsorted", "embedding_bag", "_embedding_bag", "_embedding_bag_backward", "multinomial",
        "randperm", "stack", "flip", "roll", "repeat", "repeat_interleave", "_unique2", "unique_dim",
    ),
    "dma": (
        "clone", "copy", "_to_copy", "contiguous", "cat", "constant_pad_nd", "reflection_pad2d",
        "replication_pad2d", "_unsafe_view", "split_with_sizes_copy", "narrow_copy", "expand_copy",
        "permute_copy", "t_copy", "transpose_copy", "view_copy", "unsqueeze_copy", "squeeze_copy", "slice_copy",
        "select_copy", "as_strided_copy", "alias_copy", "slice_scatter", "select_scatter", "diagonal_scatter",
        "as_strided_scatter", "_copy_from",
    ),
}

# Pure data movement: under the trainium dtype policy these keep every bit of a float64 tensor.
EXACT_OPS: tuple[str, ...] = tuple(sorted(set(NATIVE_OPS["dma"]) | {
    "index", "index_select", "gather", "scatter", "index_put", "_index_put_impl", "index_copy", "masked_select",
    "masked_scatter", "stack", "flip", "roll", "repeat", "triu", "tril", "fill", "zero", "where", "masked_fill",
    "sort", "topk", "max", "min", "amax", "amin", "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "neg",
    "abs", "_local_scalar_dense", "nonzero", "argmax", "argmin", "eq", "ne", "lt", "le", "gt", "ge",
}))

# Ops that take CPU index tensors alongside device ones (as CUDA allows for indexing); any other op refuses a
# non-scalar host tensor with CUDA's "Expected all tensors to be on the same device".
HOST_TENSOR_OPS: tuple[str, ...] = ("index", "index_put", "_index_put_impl", "_local_scalar_dense")

ENGINE_OF: dict[str, str] = {op: engine for engine, ops in NATIVE_OPS.items() for op in ops}


def native_op_names() -> list[str]:
    return sorted(ENGINE_OF)


def base_name(op: str) -> str:
    """`aten::add_.Tensor` -> `add` (the key of the tables above)."""
    name = op.split("::")[-1].split(".")[0]
    return name[:-1] if len(name) > 1 and name.endswith("_") and not name.endswith("__") else name
