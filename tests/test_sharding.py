"""Compression under tensor parallelism, without processes: every rank computes the window statistics of
its own KV heads (from its slice of q/k/v, zeros for a padded head, as SGLang's zero-weight padding gives),
plans through ``sharding.plan_on_rank`` with the other ranks' shared state, and the ranks' plans put
together must equal the single-rank plan exactly, for every policy and score and for head counts the
ranks do not divide (padding). Plus the rank counts that keep every rank's memory decisions equal."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest_policies import HIDDEN_SIZE, SCALING, policy_config, random_window_inputs
from sgl_kvevict.config import build_policy
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies import SegmentSpec
from sgl_kvevict.scoring import window_stats
from sgl_kvevict.sharding import PADDING, HeadShard, RankCounts, plan_on_rank, position_counts

CASES = [
    ("snapkv", "attn"), ("pyramidkv", "attn"), ("h2o", "obc-key"), ("tova", "attn"), ("streaming", "attn"),
    ("ada-snapkv", "attn"), ("ada-snapkv", "learned"), ("ada-pyramidkv", "obc-value"), ("lava", "attn"),
    ("lava", "learned"), ("lava", "kvzip"), ("topk", "attn"), ("topk", "learned"), ("topk", "kvzip"),
    ("snapkv", "learned"), ("dbudget", "attn"),
]  # fmt: skip
# (KV heads, query heads, ranks): even shares, one head per rank, and padding (3 heads on 2 ranks,
# 2 heads on 3 ranks: a rank of padding only).
LAYOUTS = [(2, 4, 2), (4, 8, 2), (3, 9, 3), (3, 9, 2), (2, 6, 3)]
WINDOW = 8


def _rank_stats(spec, request, shard: HeadShard, seed: int):
    """Per layer, per rank: the window statistics the rank computes from its heads' q/k/v."""
    group = spec.num_q_heads // spec.num_kv_heads
    per_layer = []
    for layer in range(spec.num_layers):
        q, k, v = random_window_inputs(spec.num_q_heads, spec.num_kv_heads, spec.end, WINDOW, seed * 1000 + layer)
        hidden = torch.randn(spec.end, HIDDEN_SIZE, generator=torch.Generator().manual_seed(seed * 1000 + layer))
        ranks = []
        for heads in shard.heads_of_rank:
            pick = [h if h != PADDING else 0 for h in heads]
            real = torch.tensor([h != PADDING for h in heads], dtype=q.dtype)
            q_rank = (q.view(spec.num_kv_heads, group, WINDOW, -1)[pick] * real[:, None, None, None]).flatten(0, 1)
            stats = window_stats(q_rank, k[pick] * real[:, None, None], v[pick] * real[:, None, None], SCALING, request)
            if request.hidden_states:
                stats = dataclasses.replace(stats, hidden_states=hidden, hidden_start=0)
            ranks.append(stats)
        per_layer.append(ranks)
    return per_layer


def _single_rank_plan(policy, spec, request, seed: int) -> CompressionPlan:
    shard = HeadShard.of(spec.num_kv_heads, 1, 0)
    compressor = policy.start(spec)
    for layer, ranks in enumerate(_rank_stats(spec, request, shard, seed)):
        compressor.observe(layer, ranks[0])
    return compressor.plan()


def _tensor_parallel_plans(policy, spec, request, tp_size: int, seed: int) -> list[CompressionPlan]:
    shards = [HeadShard.of(spec.num_kv_heads, tp_size, rank) for rank in range(tp_size)]
    heads_per_rank = len(shards[0].local_heads)
    local_spec = dataclasses.replace(
        spec, num_kv_heads=heads_per_rank, num_q_heads=heads_per_rank * spec.num_q_heads // spec.num_kv_heads
    )
    compressors = [policy.for_heads(shard.local_heads).start(local_spec) for shard in shards]
    for layer, ranks in enumerate(_rank_stats(spec, request, shards[0], seed)):
        for compressor, stats in zip(compressors, ranks):
            compressor.observe(layer, stats)
    states = [compressor.shared_state() for compressor in compressors]
    gathered = []

    def gather(state):
        gathered.append(state)
        return states

    plans = [plan_on_rank(compressor, shard, gather) for compressor, shard in zip(compressors, shards)]
    assert len(gathered) in (0, tp_size)  # every rank exchanges, or none
    return plans


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{h}kv-{q}q-tp{tp}" for h, q, tp in LAYOUTS])
@pytest.mark.parametrize("policy_name,score", CASES, ids=[f"{p}-{s}" for p, s in CASES])
def test_ranks_keep_exactly_what_one_rank_keeps(policy_name, score, layout, tmp_path):
    num_kv_heads, num_q_heads, tp_size = layout
    spec = SegmentSpec(start=0, end=90, num_layers=3, num_kv_heads=num_kv_heads, num_q_heads=num_q_heads)
    options = {"budget": "0.3", "score": score, "window": WINDOW} if policy_name != "dbudget" else {"window": WINDOW}
    if policy_name == "tova":
        options["window"] = 1
    config = policy_config(policy_name, spec, tmp_path, **options)
    policy = build_policy(config)
    request = policy.stats_request()
    whole = _single_rank_plan(policy, spec, request, seed=3)
    plans = _tensor_parallel_plans(policy, spec, request, tp_size, seed=3)
    shards = [HeadShard.of(num_kv_heads, tp_size, rank) for rank in range(tp_size)]
    for layer in range(spec.num_layers):
        for shard, plan in zip(shards, plans):
            for local, head in enumerate(shard.local_heads):
                kept = plan.layers[layer].head_positions(local)
                if head == PADDING:
                    assert len(kept) == 0
                else:
                    assert kept.tolist() == whole.layers[layer].head_positions(head).tolist(), (layer, head)
    assert sum(plan.total_kept() for plan in plans) == whole.total_kept()


def test_only_policies_that_weigh_heads_against_each_other_exchange(tmp_path):
    spec = SegmentSpec(start=0, end=90, num_layers=3, num_kv_heads=2, num_q_heads=4)
    exchanging = set()
    for policy_name, score in CASES:
        options = {"budget": "0.3", "score": score, "window": 1 if policy_name == "tova" else WINDOW}
        if policy_name == "dbudget":
            options = {"window": WINDOW}
        policy = build_policy(policy_config(policy_name, spec, tmp_path, **options))
        compressor = policy.start(spec)
        for layer, ranks in enumerate(_rank_stats(spec, policy.stats_request(), HeadShard.of(2, 1, 0), 1)):
            compressor.observe(layer, ranks[0])
        if compressor.shared_state() is not None:
            exchanging.add(policy_name)
    assert exchanging == {"ada-snapkv", "ada-pyramidkv", "lava", "topk", "dbudget"}


def test_shards_follow_sglang_padding():
    assert HeadShard.of(3, 2, 0).heads_of_rank == ((0, 1), (2, PADDING))
    assert HeadShard.of(2, 3, 2).local_heads == (PADDING,)
    assert HeadShard.of(8, 4, 1).local_heads == (2, 3)


def test_rank_counts_reserve_the_most_any_rank_keeps_on_each_side_of_a_split():
    per_rank = torch.tensor([[2, 0, 0, 1, 1], [0, 1, 1, 1, 2]])
    counts = RankCounts.of_positions(10, per_rank, entries_per_position=2)
    assert counts.per_rank().tolist() == [4, 5] and counts.reserved() == 5
    head, tail = counts.restricted(10, 12), counts.restricted(12, 15)
    assert (head.reserved(), tail.reserved()) == (2, 4)  # 6 cells after the split: it needs one more
    assert tail.restricted(13, 15).per_rank().tolist() == [2, 3]
    assert not counts.keeps_everything() and RankCounts.of_positions(0, torch.tensor([[1, 1], [1, 1]]), 2).keeps_everything()


def test_position_counts_count_every_layer_and_head():
    plan = CompressionPlan.keep_all(4, 9, num_layers=2, num_kv_heads=3)
    assert position_counts(plan).tolist() == [6] * 5


class OnGPU(torch.Tensor):
    """A host tensor that says it is on CUDA (this machine has none), as a policy's scores are on a GPU;
    ``to("cpu")`` gives a plain host tensor."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    def to(self, *args, **kwargs):
        target = torch.device(args[0] if args else kwargs["device"])
        return self.as_subclass(torch.Tensor).clone() if target.type == "cpu" else self


def test_the_exchange_over_sglangs_gloo_group_sends_host_tensors_and_returns_them_to_the_device(monkeypatch):
    """Issue 34, finding 4: SGLang's TP CPU group is gloo, which exchanges host memory; a score tensor on
    the GPU is copied to the host for the all-gather and the gathered ones back to its device."""
    from sgl_kvevict.engine import tensor_parallel

    group, exchanged = object(), []

    def all_gather(outputs, tensor, group=None):  # gloo's all-gather of 2 ranks: the other rank sends +1
        exchanged.extend((t.device.type, type(t)) for t in (*outputs, tensor))
        outputs[0].copy_(tensor)
        outputs[1].copy_(tensor + 1)

    moved_back = []
    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    monkeypatch.setattr(tensor_parallel, "to_device", lambda t, device: moved_back.append(device) or t.as_subclass(OnGPU))
    scores = torch.arange(6, dtype=torch.float32).view(1, 2, 3).as_subclass(OnGPU)
    gathered = tensor_parallel.process_group_gather(group, 2)(scores)
    assert exchanged and all(exchange == ("cpu", torch.Tensor) for exchange in exchanged)
    assert moved_back == [torch.device("cuda", 0)] * 2 and all(t.device.type == "cuda" for t in gathered)
    assert [t.as_subclass(torch.Tensor).tolist() for t in gathered] == [scores.tolist(), (scores + 1).tolist()]
