"""The options onnxruntime's accelerator providers take, as their documentation names them.

Tuned models carry provider options in their metadata (aoe.sessionopts), and the strategy
spaces propose them; both are checked against these tables, so a misspelt option is an
error here rather than an option onnxruntime ignores or refuses on a GPU machine. The
names are those of onnxruntime's execution provider pages (CUDA, TensorRT, CANN) and of
its provider option structs (OrtCUDAProviderOptionsV2, OrtTensorRTProviderOptionsV2,
OrtCANNProviderOptions); values are strings, as onnxruntime's Python API passes them.
Tables are keyed by device kind (aoe.device maps kinds to provider names).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["BOOL", "CHOICES", "OPTIONS", "check_options"]

#: how a boolean provider option is spelled
BOOL = ("0", "1")

#: kind -> option names onnxruntime documents for that provider
OPTIONS: Mapping[str, frozenset[str]] = {
    "cpu": frozenset(),
    "cuda": frozenset(
        {
            "device_id",
            "gpu_mem_limit",
            "arena_extend_strategy",
            "cudnn_conv_algo_search",
            "do_copy_in_default_stream",
            "cudnn_conv_use_max_workspace",
            "cudnn_conv1d_pad_to_nc1d",
            "enable_cuda_graph",
            "enable_skip_layer_norm_strict_mode",
            "use_tf32",
            "prefer_nhwc",
            "tunable_op_enable",
            "tunable_op_tuning_enable",
            "tunable_op_max_tuning_duration_ms",
            "use_ep_level_unified_stream",
            "fuse_conv_bias",
            "sdpa_kernel",
        }
    ),
    "tensorrt": frozenset(
        {
            "device_id",
            "trt_max_workspace_size",
            "trt_max_partition_iterations",
            "trt_min_subgraph_size",
            "trt_fp16_enable",
            "trt_bf16_enable",
            "trt_int8_enable",
            "trt_int8_calibration_table_name",
            "trt_int8_use_native_calibration_table",
            "trt_dla_enable",
            "trt_dla_core",
            "trt_engine_cache_enable",
            "trt_engine_cache_path",
            "trt_engine_cache_prefix",
            "trt_dump_subgraphs",
            "trt_force_sequential_engine_build",
            "trt_context_memory_sharing_enable",
            "trt_layer_norm_fp32_fallback",
            "trt_timing_cache_enable",
            "trt_timing_cache_path",
            "trt_force_timing_cache",
            "trt_detailed_build_log",
            "trt_build_heuristics_enable",
            "trt_sparsity_enable",
            "trt_builder_optimization_level",
            "trt_auxiliary_streams",
            "trt_tactic_sources",
            "trt_extra_plugin_lib_paths",
            "trt_profile_min_shapes",
            "trt_profile_max_shapes",
            "trt_profile_opt_shapes",
            "trt_cuda_graph_enable",
        }
    ),
    "cann": frozenset(
        {
            "device_id",
            "npu_mem_limit",
            "arena_extend_strategy",
            "enable_cann_graph",
            "dump_graphs",
            "dump_om_model",
            "precision_mode",
            "op_select_impl_mode",
            "optypelist_for_implmode",
        }
    ),
}

#: (kind, option) -> the values it takes, where the documentation enumerates them
CHOICES: Mapping[tuple[str, str], tuple[str, ...]] = {
    ("cuda", "cudnn_conv_algo_search"): ("EXHAUSTIVE", "HEURISTIC", "DEFAULT"),
    ("cuda", "arena_extend_strategy"): ("kNextPowerOfTwo", "kSameAsRequested"),
    ("cann", "arena_extend_strategy"): ("kNextPowerOfTwo", "kSameAsRequested"),
    ("cann", "precision_mode"): (
        "force_fp32",
        "cube_fp16in_fp32out",
        "force_fp16",
        "allow_fp32_to_fp16",
        "must_keep_origin_dtype",
        "allow_mix_precision",
    ),
    ("cann", "op_select_impl_mode"): ("high_precision", "high_performance"),
    ("tensorrt", "trt_builder_optimization_level"): ("0", "1", "2", "3", "4", "5"),
    **{
        ("cuda", k): BOOL
        for k in (
            "use_tf32",
            "enable_cuda_graph",
            "prefer_nhwc",
            "cudnn_conv_use_max_workspace",
            "do_copy_in_default_stream",
            "tunable_op_enable",
            "tunable_op_tuning_enable",
        )
    },
    **{
        ("tensorrt", k): BOOL
        for k in (
            "trt_fp16_enable",
            "trt_bf16_enable",
            "trt_int8_enable",
            "trt_engine_cache_enable",
            "trt_timing_cache_enable",
            "trt_cuda_graph_enable",
            "trt_int8_use_native_calibration_table",
            "trt_layer_norm_fp32_fallback",
        )
    },
    **{("cann", k): BOOL for k in ("enable_cann_graph", "dump_graphs", "dump_om_model")},
}


def check_options(kind: str, options: Mapping[str, str], where: str) -> None:
    """Raise ValueError naming `where` (the provider) and the option when `options` has
    a name the provider of `kind` does not document, or a value outside its choices."""
    known = OPTIONS.get(kind)
    if known is None:
        raise ValueError(f"{where}: no provider options are known for device kind {kind!r}")
    for name, value in options.items():
        if name not in known:
            raise ValueError(
                f"{where}: unknown provider option {name!r} (it takes: {', '.join(sorted(known)) or 'none'})"
            )
        choices = CHOICES.get((kind, name))
        if choices is not None and str(value) not in choices:
            raise ValueError(f"{where}: option {name}={value!r} is not one of {', '.join(choices)}")
