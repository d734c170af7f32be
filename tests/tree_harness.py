"""An in-process compressed radix cache on real SGLang CPU pools, driven the way the scheduler drives it.

``TreeHarness`` builds SGLang's own ``ReqToTokenPool``, ``MHATokenToKVPool`` (made contiguous by the
engine's patch, as in the server) and ``TokenToKVPoolAllocator`` on the CPU, the engine over them as
production builds it (``build_engine``: our ``CompressedRadixCache``, its coordinator and arena), and
real ``Req`` objects. ``prefill`` does what the scheduler and the model do for one
request (match, lock, allocate and evict, write the row, fill the new slots' K/V, the engine's submit,
the tree's checkpoint), with a deterministic stand-in policy so that the tests control what is kept;
``finish`` releases the request as ``release_kv_cache`` does. The coordinator sees each prefill through
its ``forward_begin``, as the attention backend calls it. Every K/V value encodes (layer, position,
KV head, conversation), so a test can check any cell's content after compression, splits and moves.

No server, no model: each test takes seconds (SGLang's own radix-cache unit tests work the same way,
``sglang/test/kits/unified_radix_cache``).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional, Protocol

import torch
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams

from sgl_kvevict.config import EvictionConfig
from sgl_kvevict.engine.adapter.factory import build_engine
from sgl_kvevict.engine.adapter.pool import install_contiguous_kv_buffers
from sgl_kvevict.engine.deferred import PREFILL
from sgl_kvevict.engine.eviction import CompressedTreeOrder
from sgl_kvevict.engine.records import node_record
from sgl_kvevict.engine.setups import EvictionSetup, ModelShape, Setups
from sgl_kvevict.local_layers import LocalLayers, WindowedLocalLayers
from sgl_kvevict.engine.tensor_parallel import RankGroup
from sgl_kvevict.plan import CompressionPlan, LayerPlan
from sgl_kvevict.policies.base import Policy, SegmentCompressor, SegmentSpec
from sgl_kvevict.scope import RequestScope, Scope
from sgl_kvevict.scoring.window import StatsRequest, WindowStats

WINDOW = 4


def kv_value(layer: int, position: int, head: int, token: int) -> float:
    """The value every dimension of an entry's K holds (V holds its negative): the entry's identity, as
    a model's K/V depend on the token at the position (here on nothing else, so shared prefixes match)."""
    return float(((token * 1024 + position) * 16 + layer) * 8 + head)


@dataclass
class KeepEvery:
    """A stand-in policy's rule: keep position ``p`` of (layer, head) when ``(p + layer + head) % every == 0``,
    plus the window (the last ``WINDOW`` positions) and nothing else."""

    every: int = 4

    def plan(self, spec: SegmentSpec) -> CompressionPlan:
        window_start = spec.end - min(WINDOW, spec.length)
        layers = []
        for layer in range(spec.num_layers):
            heads = []
            for head in range(spec.num_kv_heads):
                positions = [p for p in range(spec.start, window_start) if (p + layer + head) % self.every == 0]
                heads.append(torch.tensor(positions + list(range(window_start, spec.end)), dtype=torch.int64))
            layers.append(LayerPlan.from_heads(heads))
        return CompressionPlan(spec.start, spec.end, tuple(layers))


class Rule(Protocol):
    """What a stand-in policy keeps: the plan of a segment, without statistics."""

    def plan(self, spec: SegmentSpec) -> CompressionPlan: ...


class _RuleCompressor(SegmentCompressor):
    needs_stats = False

    def __init__(self, spec: SegmentSpec, rule: Rule):
        super().__init__(spec)
        self.rule = rule

    def observe(self, layer: int, stats: WindowStats) -> None:
        pass

    def plan(self) -> CompressionPlan:
        return self.rule.plan(self.spec)


class RulePolicy(Policy):
    """The stand-in policy: plans from ``KeepEvery`` without statistics."""

    def __init__(self, common, rule: Rule):
        super().__init__(common)
        self.rule = rule

    def stats_request(self) -> StatsRequest:
        return StatsRequest()

    def start(self, spec: SegmentSpec) -> SegmentCompressor:
        return _RuleCompressor(spec, self.rule)


class TreeHarness:
    def __init__(
        self,
        pool_slots: int = 400,
        num_layers: int = 2,
        num_kv_heads: int = 2,
        head_dim: int = 4,
        scope: Scope = RequestScope(),
        rule: Rule = KeepEvery(),
        max_requests: int = 16,
        max_context: int = 1024,
        order: Optional[CompressedTreeOrder] = None,
        ranks: Optional[RankGroup] = None,
        compress_when: str = PREFILL,
        local_layers: Optional[LocalLayers] = None,
    ):
        """``local_layers``: the model's local attention layers, trimmed to their window as a server trims
        them (the rule plans the global layers)."""
        install_contiguous_kv_buffers()
        self.shape = ModelShape(num_layers, 2 * num_kv_heads, num_kv_heads)
        self.pool = MHATokenToKVPool(
            size=pool_slots, page_size=1, dtype=torch.float32, head_num=num_kv_heads, head_dim=head_dim,
            layer_num=num_layers, device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        self.allocator = TokenToKVPoolAllocator(pool_slots, torch.float32, "cpu", kvcache=self.pool, need_sort=False)
        self.req_to_token_pool = ReqToTokenPool(
            size=max_requests, max_context_len=max_context, device="cpu", enable_memory_saver=False
        )
        config = EvictionConfig(policy="snapkv", window=WINDOW)
        policy = WindowedLocalLayers.wrap(RulePolicy(config.common, rule), local_layers)
        setups = Setups(EvictionSetup(config, policy, policy.stats_request()))
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator, page_size=1
        )
        self.engine = build_engine(
            setups, scope, self.shape, params, ranks=ranks, order=order, local_layers=local_layers,
            compress_when=compress_when,
        )  # fmt: skip
        self.tree, self.coordinator, self.arena = self.engine.tree, self.engine.coordinator, self.engine.arena
        self.space, self.stats = self.engine.space, self.engine.stats
        self.running: list[Req] = []
        self.last_match = 0  # the prefix length of the last match (SGLang's cached tokens)
        self._next_rid = 0

    # ---- the scheduler's part --------------------------------------------------------------------

    def request(self, tokens: list[int]) -> Req:
        req = Req(
            rid=f"r{self._next_rid}", origin_input_text="", origin_input_ids=array("q", tokens),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=8),
        )  # fmt: skip
        self._next_rid += 1
        req.output_ids = array("q")
        req.full_untruncated_fill_ids = array("q", tokens)
        req.extra_key = None
        req.cache_salt = None
        return req

    def match(self, req: Req) -> int:
        """Match and lock the request's prefix (``init_next_round_input`` + admission); returns its length."""
        key = RadixKey(array("q", req.origin_input_ids))
        result = self.tree.match_prefix(MatchPrefixParams(key=key, req=req))
        req.last_node = result.last_device_node
        req.lock = self.tree.lock(req.last_node)
        req.kv.cache_protected_len = result.device_prefix_len
        self.last_match = result.device_prefix_len
        return result.device_prefix_len

    def prefill(self, tokens: list[int], checkpoint: bool = True, chunk: Optional[int] = None) -> Req:
        """One request's prefill and, with ``checkpoint``, the tree's checkpoint after it. ``chunk``: SGLang's
        chunked prefill, one forward per ``chunk`` tokens, each but the last followed by the checkpoint
        SGLang's ``stash_chunked_request`` makes (``begin_chunked``/``next_chunk`` do it step by step)."""
        req = self.begin_chunked(tokens, chunk or len(tokens))
        while req.kv.kv_committed_len < len(tokens):
            self.next_chunk(req, chunk)
        if checkpoint:
            self.checkpoint(req)
        return req

    def begin_chunked(self, tokens: list[int], chunk: int) -> Req:
        """Match and lock a request, then prefill its first ``chunk`` tokens after the prefix (one forward)."""
        req = self.request(tokens)
        self.req_to_token_pool.alloc([req])
        prefix = self.match(req)
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        row[:prefix] = self.tree.path_device_indices(req.last_node)[:prefix].to(row.dtype)
        end = min(prefix + chunk, len(tokens))
        self._extend(req, prefix, end)
        self._forward(req, prefix, end)
        self.running.append(req)
        return req

    def next_chunk(self, req: Req, chunk: int) -> None:
        """The stash checkpoint of the chunk before, then the next ``chunk`` tokens' forward."""
        start = req.kv.kv_committed_len
        self.checkpoint(req)
        end = min(start + chunk, len(req.origin_input_ids))
        self._extend(req, start, end)
        self._forward(req, start, end)

    def abort(self, req: Req) -> None:
        """``release_kv_cache(checkpoint=False)`` (an abort between chunks, or a retraction)."""
        self.tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, req.kv.kv_committed_len)])
        self.tree.unlock(req.lock)
        req.lock = None
        self.tree.on_release(req, checkpointed=False)
        self.req_to_token_pool.free(req)
        self.running.remove(req)

    def checkpoint(self, req: Req) -> None:
        self.tree.checkpoint(req, up_to=req.kv.kv_committed_len)

    def decode(self, req: Req, tokens: list[int]) -> None:
        """``len(tokens)`` decode steps: each output token gets a slot (its K/V written)."""
        start = req.kv.kv_committed_len
        req.output_ids.extend(tokens)
        req.full_untruncated_fill_ids.extend(tokens)
        self._extend(req, start, start + len(tokens))

    def finish(self, req: Req) -> None:
        """The request finished: ``release_kv_cache(checkpoint=True)``, the tree keeps what it can, the rest
        of the row is freed."""
        req.finished_reason = FINISH_LENGTH(len(req.output_ids))
        committed = req.kv.kv_committed_len
        self.tree.checkpoint(req, up_to=committed)
        self.tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, committed)])
        self.tree.unlock(req.lock)
        req.lock = None
        self.tree.on_release(req, checkpointed=True)
        self.req_to_token_pool.free(req)
        self.running.remove(req)

    def _extend(self, req: Req, start: int, end: int) -> None:
        slots = self.alloc(end - start)
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        row[start:end] = slots.to(row.dtype)
        fill_ids = req.full_untruncated_fill_ids
        for position, slot in zip(range(start, end), slots.tolist()):
            for layer in range(self.shape.num_layers):
                for head in range(self.shape.num_kv_heads):
                    value = kv_value(layer, position, head, fill_ids[position])
                    self.pool.k_buffer[layer][slot, head] = value
                    self.pool.v_buffer[layer][slot, head] = -value
        req.kv.kv_committed_len = req.kv.kv_allocated_len = end

    def _forward(self, req: Req, start: int, end: int) -> None:
        """The attention backend's ``init_forward_metadata`` of the extend of ``[start, end)``."""
        forward_batch = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND, rids=[req.rid], seq_lens_cpu=torch.tensor([end]),
            extend_seq_lens_cpu=[end - start], req_pool_indices=torch.tensor([req.kv.req_pool_idx]),
        )  # fmt: skip
        self.coordinator.forward_begin(forward_batch, self.req_to_token_pool.req_to_token)

    def stats_snapshot(self) -> dict:
        return self.stats.snapshot()

    def alloc(self, count: int) -> torch.Tensor:
        """``alloc_token_slots``: evict from the tree when the allocator is short, then allocate."""
        shortfall = count - self.allocator.available_size()
        if shortfall > 0:
            self.tree.evict(EvictParams(num_tokens=shortfall))
        slots = self.allocator.alloc(count)
        if slots is None:
            raise MemoryError(f"{count} slots asked for, {self.allocator.available_size()} free after eviction")
        return slots

    # ---- checks ------------------------------------------------------------------------------------

    def uncached(self) -> int:
        """Slots the running requests own outside the tree (SGLang's ``uncached``)."""
        return sum(req.kv.kv_allocated_len - req.kv.cache_protected_len for req in self.running)

    def assert_ledger(self) -> None:
        """SGLang's strict idle check's equation, at any time: available + evictable + protected +
        uncached == total; and the arena's own ledger."""
        total = (
            self.allocator.available_size() + self.tree.evictable_size() + self.tree.protected_size() + self.uncached()
        )
        assert total == self.allocator.size, (
            f"available {self.allocator.available_size()} + evictable {self.tree.evictable_size()} + protected "
            f"{self.tree.protected_size()} + uncached {self.uncached()} != {self.allocator.size}"
        )
        self.arena.check_consistent()

    def assert_cells_hold_their_entries(self) -> None:
        """Every compressed node's cells hold exactly the K/V of the entries its segment lists."""
        for node in self.compressed_nodes():
            segment = node_record(node).segment
            node_tokens = node.key.token_ids
            expected = torch.tensor(
                [
                    kv_value(layer, position, head, node_tokens[position - segment.start])
                    for layer, position, head in zip(
                        segment.layer_ids().tolist(), segment.positions.tolist(), segment.head_ids().tolist()
                    )
                ]
            )
            cells = segment.entry_cells
            torch.testing.assert_close(self.space.k_rows[cells][:, 0], expected, rtol=0, atol=0)
            torch.testing.assert_close(self.space.v_rows[cells][:, 0], -expected, rtol=0, atol=0)

    def assert_next_turns_reuse(self, histories: list[list[int]], seed: int, new_tokens: int) -> None:
        """Each history's next turn (``new_tokens`` more) matches the whole history; then the ledger and every
        compressed node's cells hold."""
        for history in histories:
            follow_up = self.prefill(history + tokens(seed, new_tokens))
            assert self.last_match == len(history)
            self.finish(follow_up)
        self.assert_ledger()
        self.assert_cells_hold_their_entries()

    def compressed_nodes(self) -> list:
        return [node for node in self.nodes() if node_record(node).is_compressed]

    def deferred_nodes(self) -> list:
        """Dense nodes holding the plan they are compressed with under pressure."""
        return [node for node in self.nodes() if node_record(node).deferred is not None]

    def nodes(self) -> list:
        nodes, stack = [], [self.tree.root_node]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            nodes.append(node)
        return nodes

    def flush(self) -> None:
        """``flush_cache``: the tree resets, then SGLang clears the allocator and the row pool."""
        assert not self.running, "flush with running requests"
        self.tree.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()


def tokens(seed: int, length: int, first: Optional[int] = None) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 500, (length,), generator=generator).tolist()
    if first is not None:
        ids[0] = first
    return ids


def prompt_with(prefix: list[int], seed: int, length: int) -> list[int]:
    return prefix + tokens(seed, length - len(prefix))


Callback = Callable[[TreeHarness], None]
