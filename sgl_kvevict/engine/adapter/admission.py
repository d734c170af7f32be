"""Compress while prefilling, as SGLang's admission and length checks see it (``sgl_kvevict.footprint``).

Three hooks through SGLang's plugin ``HookRegistry`` (``contacts.CONTACTS``; SGLang's source is not
patched), each built for the server's ``ServingConfig``:

* ``length_limits`` (AFTER ``TpModelWorker.get_worker_info``): the longest prompt SGLang accepts
  is no longer the pool minus a few tokens but the longest prompt whose compressed peak fits the pool
  (and the model's context). The scheduler reads it once at start-up and hands it to the tokenizer
  process, which refuses a longer prompt with SGLang's own message ("Input length (N tokens) exceeds
  the maximum allowed length (M tokens)").
* ``prefill_admission`` (AROUND ``PrefillAdder._check_prefill_budget``): a prompt is admitted when its
  peak, not its dense length, fits what the pool has left (SGLang then prefills it chunk by chunk; a
  continuing chunk only needs room for itself). A request that can never fit is finished with an error
  instead of waiting forever: one whose own eviction options (``--kv-evict-per-request``) hold it dense
  and whose prompt is longer than the pool, and one whose matched prefix plus the peak of its new
  tokens exceed the pool (a cached prefix may hold dense what a fresh prefill would have compressed:
  the tail of its last block and earlier replies). Under ``--kv-evict-when pressure`` a prompt is
  admitted dense while the pool has room for it; the first one it has not puts the tree under pressure,
  and from then on, while the pool stays full, prompts are admitted by their peak (``_admit_under_pressure``).
* ``answer_clip`` (AROUND ``BaseTokenToKVPoolAllocator.max_new_tokens_for_memory``): SGLang
  clips a request's answer so that its prompt and answer fit the empty pool dense, which leaves no
  answer at all to a prompt longer than the pool; such a prompt (only ever served compressed) holds
  its peak instead.

All three do nothing unless the served setup may compress while prefilling (block scope, chunked prefill, a
budget or a model with local layers, scores from the prefill itself). A model's local layers (Gemma 3) count
as their window for every policy, ``full`` included: a block holds its global layers' budget and its local
layers' window (``footprint.LocalShare``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from sglang.srt.runtime_context import get_schedule

from sgl_kvevict.engine.adapter.slots import engine_of
from sgl_kvevict.engine.deferred import PRESSURE
from sgl_kvevict.engine.records import request_record
from sgl_kvevict.footprint import LocalShare, PrefillFootprint
from sgl_kvevict.serving import ServingConfig

# get_worker_info's tuple: (max_total_num_tokens, max_prefill_tokens, max_running_requests,
# max_queued_requests, max_req_len, max_req_input_len, ...) in SGLang 0.5.23 (managers/tp_worker.py).
_POOL_TOKENS, _MAX_REQ_LEN, _MAX_REQ_INPUT_LEN = 0, 4, 5
# SGLang keeps this many tokens between the longest request and the longest prompt (tp_worker.py).
_INPUT_MARGIN = 5


def chunk_size() -> Optional[int]:
    chunk = get_schedule().chunked_prefill_size
    return chunk if chunk is not None and chunk > 0 else None


def served_footprint(serving: ServingConfig, local: Optional[LocalShare]) -> Optional[PrefillFootprint]:
    """The footprint of the server's own setup on a model with ``local`` layers (None without one)."""
    if not serving.compresses_while_prefilling:
        return None
    return PrefillFootprint.of(serving.eviction, serving.scope, chunk_size(), local)


def _engine_local_share(allocator) -> Optional[LocalShare]:
    engine = engine_of(allocator)
    return None if engine is None else engine.coordinator.local_share


def length_limits(serving: ServingConfig):
    def raise_length_limits(info: tuple, worker, *args, **kwargs) -> Optional[tuple]:
        # Before the tree (and its engine) is built: the model's local layers from its config.
        footprint = served_footprint(serving, LocalShare.of_model(Path(worker.model_config.model_path)))
        if footprint is None:
            return None
        pool = info[_POOL_TOKENS]
        max_req_len = min(worker.model_config.context_len - 1, footprint.longest_prompt(pool, reserved_slots=1))
        if max_req_len <= info[_MAX_REQ_LEN]:
            return None
        patched = list(info)
        patched[_MAX_REQ_LEN], patched[_MAX_REQ_INPUT_LEN] = max_req_len, max_req_len - _INPUT_MARGIN
        return tuple(patched)

    return raise_length_limits


def answer_clip(serving: ServingConfig):
    def clip_answer_by_footprint(original, allocator, input_tokens: int, max_new_tokens: int, *, token_capacity: int, **kwargs):
        footprint = served_footprint(serving, _engine_local_share(allocator))
        if footprint is not None and input_tokens + 1 >= token_capacity:
            input_tokens = min(input_tokens, footprint.peak_slots(0, input_tokens))
        return original(allocator, input_tokens, max_new_tokens, token_capacity=token_capacity, **kwargs)

    return clip_answer_by_footprint


def prefill_admission(serving: ServingConfig):
    def admit_by_footprint(original, adder, req, *, extend_input_len: int, total_tokens: int, **kwargs):
        engine = engine_of(adder.token_to_kv_pool_allocator)
        if engine is None:
            return original(adder, req, extend_input_len=extend_input_len, total_tokens=total_tokens, **kwargs)
        if serving.compress_when == PRESSURE:
            return _admit_under_pressure(original, adder, req, engine, extend_input_len=extend_input_len, total_tokens=total_tokens, **kwargs)
        footprint = engine.coordinator.footprint_of(req) if serving.compresses_while_prefilling else None
        if footprint is not None:
            return _admit_compressed(original, adder, req, engine, footprint, extend_input_len=extend_input_len, total_tokens=total_tokens, **kwargs)
        pool = adder.token_to_kv_pool_allocator.size
        if served_footprint(serving, engine.coordinator.local_share) is not None and extend_input_len + 1 > pool:
            return _refuse(req, f"Input length ({extend_input_len} tokens) exceeds what the KV pool holds with this "
                                f"request's own eviction options, which keep a prompt dense while it is prefilled ({pool} tokens)")  # fmt: skip
        return original(adder, req, extend_input_len=extend_input_len, total_tokens=total_tokens, **kwargs)

    return admit_by_footprint


def _admit_under_pressure(original, adder, req, engine, *, extend_input_len: int, total_tokens: int, **kwargs):
    """``--kv-evict-when pressure``: a prompt is admitted dense while the pool has room for it. One the pool
    cannot take dense (SGLang would keep it waiting for running requests to finish) puts the tree under
    pressure, and while the tree is under pressure a prompt is admitted by its compressed peak, as under
    ``prefill``, and every segment of it is then stored compressed at its checkpoint. Counted dense, a
    prompt whose blocks will be compressed at once would wait behind the room it never takes, and SGLang
    would evict cached prompts to reserve it."""
    footprint = engine.coordinator.footprint_of(req)
    if footprint is None:
        return original(adder, req, extend_input_len=extend_input_len, total_tokens=total_tokens, **kwargs)
    tree = engine.tree
    if not tree.under_pressure:
        verdict = original(adder, req, extend_input_len=extend_input_len, total_tokens=total_tokens, **kwargs)
        if verdict[0]:
            return verdict
        tree.felt_pressure()
    verdict = _admit_compressed(original, adder, req, engine, footprint, extend_input_len=extend_input_len, total_tokens=total_tokens, **kwargs)
    record = request_record(req)
    if verdict[0] and not record.admitted_compressed:
        record.admitted_compressed = True
        engine.stats.count("prompts_admitted_compressed")
    return verdict


def _admit_compressed(original, adder, req, engine, footprint: PrefillFootprint, *, extend_input_len: int, total_tokens: int, **kwargs):
    """SGLang's check with the prompt counted by its compressed peak instead of its dense length; a prompt that
    can never fit, its cached prefix included, is finished with an error instead."""
    pool = adder.token_to_kv_pool_allocator.size
    peak = footprint.peak_slots(req.prefix_len, req.prefix_len + extend_input_len)
    held = engine.tree.path_slots(req.last_node)
    if held + peak > pool:
        return _refuse(req, f"Input length ({req.prefix_len + extend_input_len} tokens) needs {held + peak} KV "
                            f"slots at its peak with its cached prefix ({held} of them); the KV pool holds {pool}")  # fmt: skip
    return original(adder, req, extend_input_len=extend_input_len, total_tokens=total_tokens + peak - extend_input_len, **kwargs)


def _refuse(req, reason: str):
    req.set_finish_with_abort(reason)
    return False, None  # it is admitted next round as SGLang's one-token stub of an aborted request
