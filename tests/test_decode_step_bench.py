"""benchmarks/decode_step.py without a server: py-spy stacks sorted into the parts of a step, ratios
against stock taken round by round, and the report rendered from them."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks import decode_step
from benchmarks.decode_step import BASELINE, DecodeStepConfig, markdown, profile_parts, step_part, step_seconds, summarize

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


def test_step_time_counts_every_token_after_the_first_chunk_even_when_chunks_carry_several():
    reply = SimpleNamespace(token_times=[1.0, 1.5, 3.0], completion_tokens=5)  # 4 steps in 2 s
    assert step_seconds(reply) == 0.5


def run(round_index: int, variant: str, steps: dict[int, list[float]]) -> dict:
    samples = {"batches": {b: {"step_seconds": s} for b, s in steps.items()}, "stats": {"compressed_tokens": 10}, "profile": None}
    return {"round": round_index, "variant": variant, "label": f"{variant} r{round_index}", "load_average": (1.0, 1.0, 1.0),
            "error": None, "samples": samples}  # fmt: skip


def test_ratios_are_against_stock_of_the_same_round():
    config = DecodeStepConfig(
        model="m", variants=(BASELINE, "full"), batches=(1, 4), prompt_tokens=100, decode_tokens=8, rounds=2, pool_tokens=1000, seed=0
    )  # fmt: skip
    runs = [
        run(0, BASELINE, {1: [0.10], 4: [0.40, 0.40, 0.40, 0.40]}),
        run(0, "full", {1: [0.05], 4: [0.20, 0.20, 0.30, 0.20]}),
        run(1, "full", {1: [0.20], 4: [0.80] * 4}),  # a slower machine in round 2, for both servers
        run(1, BASELINE, {1: [0.40], 4: [1.60] * 4}),
    ]
    summary = summarize(runs, config)
    assert summary["full"][1]["vs_stock_by_round"] == [2.0, 2.0]  # across rounds the steps differ 4x
    assert summary["full"][4]["vs_stock"] == 2.0 and summary["full"][4]["step_ms_by_round"] == [200.0, 800.0]
    report = {"meta": {"command": "c", "name": "decode_step", "config": vars(config) | {"variants": list(config.variants)},
                       "environment": decode_step.environment()}, "runs": runs, "summary": summary}  # fmt: skip
    text = markdown(report)
    assert "| 4 | 1000.0 400-1600 | 500.0 200-800 | **2.00** 2.00-2.00 |" in text
