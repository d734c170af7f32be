"""benchmarks/decode_step.py without a server: py-spy stacks sorted into the parts of a step, the
rounds' order, ratios against stock and keep-99 taken round by round (a round without its stock run
refused), the profile's attention per variant, and the report rendered from them."""

from __future__ import annotations

import warnings
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from benchmarks import decode_step
from benchmarks.engine_overhead import MeasurementError
from benchmarks.decode_step import (
    BASELINE,
    KEEP_ALL,
    DecodeStepConfig,
    SummaryError,
    kv_pool_dtype,
    markdown,
    profile_parts,
    rounds_with_baseline,
    server_variant,
    step_part,
    step_seconds,
    summarize,
)

SCHEDULER = "run_scheduler_process (scheduler.py:6368);event_loop_overlap (scheduler.py:1200)"
MODEL = f"{SCHEDULER};forward_batch_generation (tp_worker.py:400);forward (model_runner.py:900);forward (llama.py:300)"


def test_a_sample_belongs_to_the_part_its_innermost_named_frame_says():
    attention = f"{MODEL};forward (radix_attention.py:90);forward_decode (attention.py:140)"
    assert step_part(f"{attention};_decode_attention (attention.py:220)") == "decode attention (one pass over cells and dense keys)"
    assert step_part(f"{attention};_init_segment_metadata (attention.py:180);append (batch.py:300)").startswith("per-forward metadata")
    assert step_part(f"{attention};_run_sdpa_forward_decode (torch_native_backend.py:250)") == "stock SDPA decode (per request)"
    assert step_part(f"{MODEL};forward (linear.py:10)").startswith("model:")
    assert step_part(f"{SCHEDULER};process_batch_result (scheduler.py:100)").startswith("scheduler:")
    assert step_part("<module> (<string>:1);select (selectors.py:10)") == "other (idle, IPC)"
    raw = f"{MODEL};forward (linear.py:10) 30\n{SCHEDULER};recv (zmq.py:1) 5\n\n"
    assert profile_parts(raw) == {"model: projections, MLP, norms, rotary, logits": 30, "scheduler: batches, results, streaming out": 5}


def test_the_kv_pool_dtype_is_read_from_sglangs_allocation_line():
    # As SGLang 0.5.23 logs it on CPU (mem_cache/memory_pool.py) and where decode graphs are captured.
    assert kv_pool_dtype("x\n[t] KV Cache is allocated. dtype: torch.float32, #tokens: 677, K size: 0.00 GB\n") == "float32"
    assert kv_pool_dtype("[t] KV Cache VA upper bound. dtype: torch.bfloat16, #tokens: 9\n") == "bfloat16"
    with pytest.raises(MeasurementError, match="KV dtype is unknown"):
        kv_pool_dtype("[t] Load weight end.\n")


def test_step_time_counts_every_token_after_the_first_chunk_even_when_chunks_carry_several():
    reply = SimpleNamespace(token_times=[1.0, 1.5, 3.0], completion_tokens=5)  # 4 steps in 2 s
    assert step_seconds(reply) == 0.5


def run(round_index: int, variant: str, steps: dict[int, list[float]], profile: dict | None = None) -> dict:
    samples = {"batches": {b: {"step_seconds": s} for b, s in steps.items()}, "stats": {"compressed_tokens": 10}, "profile": profile,
               "dtypes": {"dtype": "bfloat16", "kv_cache_dtype": "auto", "kv_pool": "bfloat16"}}  # fmt: skip
    return {"round": round_index, "variant": variant, "label": f"{variant} r{round_index}", "load_average": (1.0, 1.0, 1.0),
            "error": None, "samples": samples}  # fmt: skip


def config_of(variants: tuple[str, ...], rounds: int = 2) -> DecodeStepConfig:
    return DecodeStepConfig(
        model="m", variants=variants, batches=(1, 4), prompt_tokens=100, decode_tokens=8, rounds=rounds, pool_tokens=1000, seed=0
    )  # fmt: skip


def report_of(config: DecodeStepConfig, runs: list[dict]) -> dict:
    meta = {"command": "c", "name": "decode_step", "config": asdict(config), "environment": decode_step.environment(),
            "cpu_flags": {"avx512f": True, "avx512_bf16": False, "amx_bf16": False, "amx_tile": False}}  # fmt: skip
    return {"meta": meta, "runs": runs, "summary": summarize(runs, config)}


def test_every_round_runs_every_variant_in_a_rotated_order():
    config = config_of(("stock", "full", "keep-99"), rounds=4)
    orders = [config.round_order(r) for r in range(4)]
    assert orders == [("stock", "full", "keep-99"), ("full", "keep-99", "stock"), ("keep-99", "stock", "full"), ("stock", "full", "keep-99")]


def test_ratios_are_against_stock_and_keep_99_of_the_same_round():
    config = config_of((BASELINE, "full", KEEP_ALL, "default-block"))
    runs = [
        run(0, BASELINE, {1: [0.10], 4: [0.40, 0.40, 0.40, 0.40]}),
        run(0, "full", {1: [0.05], 4: [0.20, 0.20, 0.30, 0.20]}),
        run(0, KEEP_ALL, {1: [0.05], 4: [0.10] * 4}),
        run(0, "default-block", {1: [0.025], 4: [0.05] * 4}),
        run(1, "full", {1: [0.20], 4: [0.80] * 4}),  # a slower machine in round 2, for every server
        run(1, KEEP_ALL, {1: [0.40], 4: [0.40] * 4}),
        run(1, "default-block", {1: [0.10], 4: [0.40] * 4}),
        run(1, BASELINE, {1: [0.40], 4: [1.60] * 4}),
    ]
    report = report_of(config, runs)
    steps = report["summary"]["steps"]
    assert report["summary"]["rounds"] == [0, 1]
    assert steps["full"][1]["vs"][BASELINE]["by_round"] == [2.0, 2.0]  # across rounds the steps differ 4x
    assert steps["full"][4]["vs"][BASELINE]["median"] == 2.0 and steps["full"][4]["step_ms_by_round"] == [200.0, 800.0]
    assert steps["default-block"][4]["vs"][KEEP_ALL]["by_round"] == [2.0, 1.0]
    assert steps[KEEP_ALL][4]["vs"] == {BASELINE: {"rounds": [0, 1], "by_round": [4.0, 4.0], "median": 4.0}}
    assert steps[BASELINE][4]["vs"] == {}
    text = markdown(report)
    header = ("| batch | stock step (ms) | full step (ms) | full / stock tok/s | full / keep-99 tok/s | keep-99 step (ms) | "
              "keep-99 / stock tok/s | default-block step (ms) | default-block / stock tok/s | default-block / keep-99 tok/s |")  # fmt: skip
    assert header in text
    assert ("| 4 | 1000.0 400-1600 | 500.0 200-800 | **2.00** 2.00-2.00 | **0.50** 0.50-0.50 | 250.0 100-400 | **4.00** 4.00-4.00 | "
            "225.0 50-400 | **6.00** 4.00-8.00 | **1.50** 1.00-2.00 |") in text  # fmt: skip
    assert "rounds summarized (those whose stock run succeeded): 1, 2." in text
    assert "`--dtype bfloat16 --kv-cache-dtype auto`, KV pool bfloat16 (stock r0, full r0, keep-99 r0, default-block r0, full r1" in text
    assert "CPU flags: avx512f yes, avx512_bf16 no, amx_bf16 no, amx_tile no" in text
    assert "`keep-99`: `--kv-evict-policy topk --kv-evict-default budget=0.99 --kv-evict-default score=learned`" in text


def test_a_round_without_its_stock_run_is_refused_not_dropped():
    config = config_of((BASELINE, "full"))
    runs = [run(0, BASELINE, {1: [0.1], 4: [0.4] * 4}), run(0, "full", {1: [0.1], 4: [0.4] * 4}), run(1, "full", {1: [0.1], 4: [0.4] * 4})]
    with pytest.raises(SummaryError, match=r"round\(s\) 2 have no successful stock run"):
        summarize(runs, config)
    failed = {**run(1, BASELINE, {}), "error": "server exited", "samples": None}
    with pytest.raises(SummaryError, match="round"):
        summarize([*runs, failed], config)
    # What a run writes while round 2 waits for its stock server: round 1 only, said on the page.
    summarized = [r for r in runs if r["round"] in rounds_with_baseline([*runs, failed])]
    report = {**report_of(config, summarized), "runs": [*runs, failed]}
    assert report["summary"]["rounds"] == [0]
    text = markdown(report)
    assert "rounds summarized (those whose stock run succeeded): 1." in text and "Failed: stock r1: server exited" in text


def test_the_profile_summary_holds_each_variants_attention_ms_per_step():
    config = config_of((BASELINE, KEEP_ALL, "default-block"), rounds=1)
    attention, model = "decode attention (one pass over cells and dense keys)", "model: projections, MLP, norms, rotary, logits"
    metadata = "per-forward metadata (requests, views, cell index, dense layout)"
    runs = [
        run(0, BASELINE, {1: [0.1], 4: [0.4] * 4}, {"batch": 4, "step_seconds": [0.8] * 4,
                                                    "samples": {"stock SDPA decode (per request)": 90, model: 10}}),
        run(0, KEEP_ALL, {1: [0.1], 4: [0.4] * 4}, {"batch": 4, "step_seconds": [0.3] * 4,
                                                    "samples": {attention: 50, metadata: 10, model: 40}}),
        run(0, "default-block", {1: [0.1], 4: [0.4] * 4}, {"batch": 4, "step_seconds": [0.2] * 4,
                                                           "samples": {attention: 50, model: 50}}),
    ]  # fmt: skip
    report = report_of(config, runs)
    profile = report["summary"]["profile"]
    assert list(profile) == [BASELINE, KEEP_ALL, "default-block"]
    assert profile[BASELINE]["attention_ms"] == pytest.approx(720.0)
    assert profile[KEEP_ALL]["attention_ms"] == pytest.approx(180.0) and profile[KEEP_ALL]["ms_per_part"][model] == pytest.approx(120.0)
    assert profile["default-block"]["attention_ms"] / profile[KEEP_ALL]["attention_ms"] == pytest.approx(100 / 180)
    assert profile["default-block"]["attention_vs_keep_all"] == {"by_round": {0: pytest.approx(100 / 180)}, "median": pytest.approx(100 / 180)}
    assert "attention_vs_keep_all" not in profile[KEEP_ALL]
    text = markdown(report)
    assert "| **attention backend (the parts above the model's)** | 720.0 ms | 180.0 ms | 100.0 ms |" in text
    assert f"| {attention} | - | 50% (150.0 ms) | 50% (100.0 ms) |" in text
    assert f"| **attention / {KEEP_ALL}'s, same round (median; by round)** | 4.00 (4.00) | - | 0.56 (0.56) |" in text


def test_every_round_is_profiled_and_the_attention_share_is_the_median_of_same_round_ratios():
    config = config_of((BASELINE, KEEP_ALL, "default-block"), rounds=3)
    attention, model = "decode attention (one pass over cells and dense keys)", "model: projections, MLP, norms, rotary, logits"

    def profiled(round_index, variant, attention_samples, step):
        return run(round_index, variant, {1: [0.1], 4: [0.4] * 4},
                   {"batch": 4, "step_seconds": [step] * 4, "samples": {attention: attention_samples, model: 100 - attention_samples}})  # fmt: skip

    # keep-99's attention 150, 100, 200 ms; the default's 60, 50, 40 ms: ratios 0.4, 0.5, 0.2. A ratio of
    # medians (50 / 150 = 0.33) would pair passes from different rounds.
    runs = [run(r, BASELINE, {1: [0.1], 4: [0.4] * 4}) for r in range(3)]
    runs += [profiled(0, KEEP_ALL, 50, 0.3), profiled(1, KEEP_ALL, 50, 0.2), profiled(2, KEEP_ALL, 50, 0.4)]
    runs += [profiled(0, "default-block", 30, 0.2), profiled(1, "default-block", 25, 0.2), profiled(2, "default-block", 20, 0.2)]
    runs.append(profiled(3, "default-block", 10, 0.2) | {"error": "server exited"})  # a failed run adds nothing
    profile = report_of(config, runs)["summary"]["profile"]
    assert profile[KEEP_ALL]["rounds"] == [0, 1, 2] and profile[KEEP_ALL]["attention_ms"] == pytest.approx(150.0)
    assert profile["default-block"]["attention_by_round"] == {0: pytest.approx(60.0), 1: pytest.approx(50.0), 2: pytest.approx(40.0)}
    assert profile["default-block"]["attention_ms"] == pytest.approx(50.0) and profile["default-block"]["step_ms"] == pytest.approx(200.0)
    ratio = profile["default-block"]["attention_vs_keep_all"]
    assert ratio["by_round"] == {0: pytest.approx(0.4), 1: pytest.approx(0.5), 2: pytest.approx(0.2)} and ratio["median"] == pytest.approx(0.4)
    assert profile["default-block"]["ms_per_part"][model] == pytest.approx(150.0)  # median of 140, 150, 160


def test_variants_rank_by_the_chosen_score_and_bad_input_is_refused():
    assert server_variant(KEEP_ALL, "attn").launcher_flags() == [
        "--kv-evict-policy", "topk", "--kv-evict-default", "budget=0.99", "--kv-evict-default", "score=attn"]  # fmt: skip
    assert server_variant("full", "attn").launcher_flags() == ["--kv-evict-policy", "full"]
    with pytest.raises(ValueError, match="--score nope: choose from attn"):
        DecodeStepConfig(**{**asdict(config_of((BASELINE,))), "score": "nope"})
    with pytest.raises(ValueError, match="each once"):
        config_of((BASELINE, "full", "full"))


def test_the_figure_of_a_run_with_only_stock_so_far_has_no_empty_legend(tmp_path):
    # The report is rewritten after every server: after the first, the ratio axis has no line yet.
    config = config_of((BASELINE, "full"), rounds=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns of a legend without artists
        decode_step.plot(report_of(config, [run(0, BASELINE, {1: [0.1], 4: [0.4] * 4})]), tmp_path / "decode_step.png")
    assert (tmp_path / "decode_step.png").stat().st_size > 0
