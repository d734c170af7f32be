"""Entry point of the ``sglang.srt.plugins`` group: runs in every SGLang process (scheduler included).

SGLang spawns its processes, so registries filled in the launcher do not reach the scheduler; this
entry point is how ours get there (sglang-0.5.23-hooks.md §5.4). With a policy set (the launcher's
``KVEVICT_SERVING``) it registers:

* the ``sgl_kvevict`` radix-cache backend (the launcher passes ``--radix-cache-backend sgl_kvevict``);
* our attention backend *in place of* the stock ``torch_native`` factory, so the backend name and
  every SGLang gate keyed on it (CUDA-graph disabling, Triton support) stay the stock ones. On CUDA
  the stock ``flashinfer`` factory is replaced by one that refuses: the FlashInfer segment attention
  is not built yet, and running the stock backend over compressed nodes would read placeholder slots.

Everything heavy is imported inside the factories, which run only in the scheduler process.
"""

from __future__ import annotations

from sgl_kvevict.serving import ServingConfig

RADIX_CACHE_BACKEND = "sgl_kvevict"


def register() -> None:
    if not ServingConfig.from_env().enabled:
        return
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if RADIX_CACHE_BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(RADIX_CACHE_BACKEND, _create_radix_cache)
    ATTENTION_BACKENDS["torch_native"] = _create_torch_backend
    ATTENTION_BACKENDS["flashinfer"] = _refuse_flashinfer


def _create_radix_cache(ctx):
    from sgl_kvevict.engine.factory import create_compressed_radix_cache

    return create_compressed_radix_cache(ctx)


def _create_torch_backend(runner):
    from sgl_kvevict.engine.attention import KVEvictTorchBackend

    return KVEvictTorchBackend(runner)


def _refuse_flashinfer(runner):
    raise NotImplementedError(
        "sgl-kvevict: KV eviction on CUDA (FlashInfer segment attention) is not implemented in this version; "
        "serve with --kv-evict-policy none on CUDA, or use the CPU development mode (torch_native)"
    )
