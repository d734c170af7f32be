"""The names SGLang 0.5.23 imports from ``sgl_kernel`` (read from its source).

The CPU development mode stands in for the top-level module only: on CPU, SGLang guards its imports of
``sgl_kernel`` submodules (``scalar_type``, ``flash_attn``, ``kvcacheio``, ...) with ``except
ImportError`` fallbacks or does not reach them, and a stand-in submodule would defeat the fallbacks.
On CUDA three submodules are imported unguarded at module import time (``CUDA_SUBMODULE_NAMES``): the
GPU kit"s stand-in package (``tools/gpu_kit_files/sgl_kernel``) provides those and keeps every other
submodule absent. Regenerate when the SGLang pin moves: collect the names of every
``from sgl_kernel[.submodule] import ...`` in the sglang package (``tests/test_gpu_kit.py`` checks
both lists against the installed sglang).
"""

IMPORTED_NAMES = (
    "apply_token_bitmask_inplace_cuda", "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu", "assign_req_to_token_pool_cpu", "awq_dequantize", "biased_topk",
    "build_draft_decode_metadata_cpu", "build_tree_kernel_efficient", "build_tree_kernel_efficient_cpu",
    "compress_norm_rope_store", "concat_mla_k", "copy_all_layer_kv_cache_cpu", "cutlass_w4a8_moe_mm",
    "es_fp8_blockwise_scaled_grouped_mm", "es_sm100_mxfp8_blockscaled_grouped_mm",
    "es_sm100_mxfp8_blockscaled_grouped_quant", "fast_topk_transform_fused",
    "fast_topk_transform_ragged_fused", "fast_topk_v2", "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu", "flash_compress128_decode", "flash_compress128_prefill",
    "flash_compress4_decode", "flash_compress4_prefill", "flash_mla_decode",
    "flash_mla_decode_get_workspace_size", "flash_mla_get_workspace_size", "flash_mla_prefill",
    "flash_mla_prefill_get_workspace_size", "flash_mla_sparse_fwd", "flash_mla_with_kvcache",
    "fp8_blockwise_scaled_grouped_mm", "fp8_mqa_logits", "fp8_paged_mqa_logits",
    "fp8_paged_mqa_logits_triton", "fused_add_rmsnorm", "fused_experts", "fused_hc_head",
    "fused_inplace_qknorm_rope", "fused_k_norm_rope_flashmla", "fused_q_indexer_rope_hadamard_quant",
    "fused_q_norm_rope", "fused_qk_rope_with_cos_sin_cache_inplace", "gdn_attention", "gelu_and_mul",
    "gelu_quick", "gelu_tanh_and_mul", "gemma_fused_add_rmsnorm", "gemma_rmsnorm",
    "get_cutlass_w4a8_moe_mm_data", "hadamard_transform", "hash_topk", "hc_post", "hc_split_sinkhorn",
    "infllmv2_attn_stage1", "int8_scaled_mm", "load_cache_to_device_buffer_dsv4_mla",
    "load_cache_to_device_buffer_mla", "max_pooling_1d_varlen", "merge_state_v2", "metal",
    "mhc_fused_post_pre", "mhc_pre", "min_p_sampling_from_probs", "minimax_decode_topk", "moe_fused_gate",
    "moe_sum", "moe_sum_reduce", "multimodal_rotary_embedding", "plan_compress_decode",
    "plan_compress_decode_legacy", "plan_compress_prefill", "plan_compress_prefill_legacy", "rmsnorm",
    "rotary_embedding", "rotate_input_ids_cpu", "sgl_per_tensor_quant_fp8", "sgl_per_token_quant_fp8",
    "shuffle_rows", "silu_and_mul", "silu_and_mul_clamp", "spatial", "store_cache_xpu", "top_k",
    "top_k_renorm_prob", "top_k_top_p_sampling_from_probs", "top_p_renorm_prob", "topk_sigmoid",
    "topk_softmax", "transfer_cache_dsv4_mla", "tree_speculative_sampling_target_only",
    "verify_tree_greedy", "verify_tree_greedy_cpu", "weak_ref_tensor",
)

# The submodules SGLang imports without an ImportError fallback on CUDA, and the names it takes from each.
CUDA_SUBMODULE_NAMES = {
    "utils": ("is_arch_support_pdl",),
    "quantization": ("ggml_dequantize", "ggml_moe_a8", "ggml_moe_a8_vec", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8"),
    "kvcacheio": (
        "get_device_accessible_ptr", "transfer_embedding_ranges_direct", "transfer_kv_all_layer",
        "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_lf_ph",
        "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_direct", "transfer_kv_per_layer",
        "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf",
        "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf",
    ),
}
