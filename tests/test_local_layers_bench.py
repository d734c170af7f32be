"""The Gemma 3 local-layers benchmark's mechanics: the model it builds, the flags it hands the drivers,
and the answers / memory tables it adds to their report (no server: the drivers have their own tests)."""

from __future__ import annotations

import json

from benchmarks import local_layers, multiturn, sglang_client
from sgl_kvevict.architectures import local_attention_layers, local_layers_of_config


def test_shape_is_gemma3_1b_pattern():
    overrides = local_layers.SHAPE["overrides"]
    config = {"model_type": "gemma3_text", "num_hidden_layers": local_layers.SHAPE["num_layers"], **overrides}
    layers, window = local_layers_of_config(config)
    assert window == 256 and layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)  # every 6th layer global, as Gemma-3-1B


def test_model_folder_is_built_once_and_served_with_local_layers(tmp_path):
    shape = {**local_layers.SHAPE, "num_layers": 6}
    shape["overrides"] = {**shape["overrides"], "layer_types": shape["overrides"]["layer_types"][:6], "hidden_size": 64,
                          "intermediate_size": 64}  # fmt: skip
    logged = []
    folder = local_layers.model_folder(tmp_path, shape, logged.append)
    assert local_attention_layers(folder) == ((0, 1, 2, 3, 4), 256)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] and (folder / "tokenizer_config.json").exists()
    assert local_layers.model_folder(tmp_path, shape, logged.append) == folder and len(logged) == 1
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no staging folder left


def test_given_flags_override_the_defaults(tmp_path):
    args = multiturn.build_parser().parse_args(
        ["compare", *local_layers.driver_argv(tmp_path, local_layers.MULTITURN, ["--tight-pool", "5000", "--scopes", "block"])]
    )
    assert (args.model, args.tight_pool, args.scopes, args.policies) == (str(tmp_path), 5000, "block", "topk:attn")
    assert args.server_arg == ["--dtype=float32"] and args.name == "gemma3_local_layers"
    args = sglang_client.build_parser().parse_args(local_layers.driver_argv(tmp_path, local_layers.CLIENT, []))
    assert (args.model, args.name, args.server_arg) == (str(tmp_path), "gemma3_local_layers_client", ["--dtype=float32"])
    assert local_layers._option(["--out", "a", "--out=b"], "--out", "c") == "b"


def _run(label: str, policy: str, replies: list[str], last: dict | None = None) -> dict:
    records = [{"user": i // 2, "turn": i % 2, "reply": reply, "error": None} for i, reply in enumerate(replies)]
    variant = {"policy": policy}
    return {"label": label, "variant": variant, "pool_tokens": 700, "error": None, "records": records, "metrics": {"wall_seconds": 9.5},
            "kvevict_stats": {"last": last} if last else {"available": False}}  # fmt: skip


def test_answers_and_memory_are_added_to_the_report(tmp_path):
    stats = {"arena_cells_per_slot": 12, "kept_cells": 2400, "compressed_tokens": 1000, "compressed_nodes": 2}
    runs = [
        _run("vanilla", "none", ["a", "b", "c", "d"]),
        _run("full", "full", ["a", "b", "c", "d"], stats),
        _run("topk", "topk", ["a", "x", "c", "y"], stats),
    ]
    payload = {"meta": {"conversations": {"users": 2}}, "runs": runs}
    (tmp_path / "r.json").write_text(json.dumps(payload))
    (tmp_path / "r.md").write_text("# report\n")
    for _ in range(2):  # a rerun replaces the section
        extra = local_layers.add_answers(tmp_path, "r", "python -m benchmarks.local_layers multiturn")
    assert [(r["server"], r["identical"], r["compared"], r["first_differing"]) for r in extra["answers"]] == [
        ("vanilla", 4, 4, None), ("full", 4, 4, None), ("topk", 2, 4, [0, 1])
    ]  # fmt: skip
    (memory, _) = extra["memory"]
    assert memory["kept_fraction"] == 0.2 and memory["slots_per_conversation"] == 100 and memory["dense_slots_per_conversation"] == 500
    text = (tmp_path / "r.md").read_text()
    assert text.count("## Answers and memory") == 1 and "| full | 700 | 4/4 | - | 9.5 |" in text and "| topk | 700 | 2/4 | (0, 1) | 9.5 |" in text
    assert "| vanilla | 700 | (stock) | - | 9.5 |" in text
    assert json.loads((tmp_path / "r.json").read_text())["local_layers"] == extra
