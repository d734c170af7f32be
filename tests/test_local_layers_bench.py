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


# The real Gemma 3 270M (``--model gemma3-270m``): a chat-template copy of its folder, its own defaults.


def _source_model(tmp_path):
    source = tmp_path / "models" / "gemma3-270m"
    source.mkdir(parents=True)
    (source / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "sliding_window": 512}))
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    (source / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "tokenizer_class": "GemmaTokenizer"}))
    (source / "tokenizer.json").write_text(json.dumps({"model": "x" * 300}))  # over the (patched) copy limit below
    (source / "model.safetensors").write_bytes(b"\0" * 64)
    (source / "sgl_kvevict_manifest.json").write_text("{}")
    return source


def test_chat_folder_adds_the_template_copies_small_json_and_symlinks_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(local_layers, "COPIED_MAX_BYTES", 200)
    source, cache, logged = _source_model(tmp_path), tmp_path / "cache", []
    folder = local_layers.chat_folder(source, cache, logged.append)
    assert folder == cache / "gemma3-270m-chat" and len(logged) == 1
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == local_layers.GEMMA_CHAT_TEMPLATE and config["tokenizer_class"] == "GemmaTokenizer"
    assert "chat_template" not in json.loads((source / "tokenizer_config.json").read_text())  # the source is untouched
    for name in ("model.safetensors", "tokenizer.json"):
        assert (folder / name).is_symlink() and (folder / name).resolve() == (source / name).resolve()
    for name in ("config.json", "generation_config.json"):
        assert not (folder / name).is_symlink() and (folder / name).read_text() == (source / name).read_text()
    assert not (folder / "sgl_kvevict_manifest.json").exists()  # the bundled model's manifest is not the copy's
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no staging folder left


def test_chat_folder_is_reused_and_rebuilt_when_stale(tmp_path):
    source, cache, logged = _source_model(tmp_path), tmp_path / "cache", []
    folder = local_layers.chat_folder(source, cache, logged.append)
    built = (folder / "tokenizer_config.json").stat().st_mtime_ns, (folder / "tokenizer_config.json").stat().st_ino
    assert local_layers.chat_folder(source, cache, logged.append) == folder and len(logged) == 1  # reused as is
    assert ((folder / "tokenizer_config.json").stat().st_mtime_ns, (folder / "tokenizer_config.json").stat().st_ino) == built
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))  # template lost: rebuilt
    assert local_layers.chat_folder(source, cache, logged.append) == folder and len(logged) == 2
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == local_layers.GEMMA_CHAT_TEMPLATE
    (folder / "model.safetensors").unlink()  # a weight file missing: rebuilt
    local_layers.chat_folder(source, cache, logged.append)
    assert len(logged) == 3 and (folder / "model.safetensors").is_symlink()
    (source / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "sliding_window": 1024}))  # source rebuilt
    local_layers.chat_folder(source, cache, logged.append)
    assert len(logged) == 4 and json.loads((folder / "config.json").read_text())["sliding_window"] == 1024
    assert sorted(p.name for p in cache.iterdir()) == [folder.name]


def _render(messages, add_generation_prompt=True):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders
    environment.globals["raise_exception"] = raise_exception
    template = environment.from_string(local_layers.GEMMA_CHAT_TEMPLATE)
    return template.render(messages=messages, bos_token="<bos>", add_generation_prompt=add_generation_prompt)


def test_the_template_is_gemmas_instruction_turn_format():
    messages = [{"role": "user", "content": "Read this. "}, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Q?"}]
    assert _render(messages) == (
        "<bos><start_of_turn>user\nRead this.<end_of_turn>\n<start_of_turn>model\nDone.<end_of_turn>\n"
        "<start_of_turn>user\nQ?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert _render([{"role": "system", "content": "Be brief."}, *messages[:1]], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nBe brief.\n\nRead this.<end_of_turn>\n"
    )
    try:
        _render([messages[1]])
    except ValueError as error:
        assert "alternate" in str(error)
    else:
        raise AssertionError("an assistant turn first must be refused")


def test_model_flag_is_taken_out_of_the_drivers_flags():
    assert local_layers.split_model(["--users", "2"]) == ("tiny", ["--users", "2"])
    assert local_layers.split_model(["--model", "gemma3-270m", "--users", "2"]) == ("gemma3-270m", ["--users", "2"])
    assert local_layers.split_model(["--model=gemma3-270m", "--model=tiny"]) == ("tiny", [])
    assert local_layers.split_model(["--model", "/a/folder"]) == ("tiny", ["--model", "/a/folder"])  # a folder: the driver's


def test_real_model_defaults(tmp_path):
    args = multiturn.build_parser().parse_args(["compare", *local_layers.driver_argv(tmp_path, local_layers.REAL_MULTITURN, [])])
    assert (args.model, args.pools, args.tight_fraction, args.tight_pool) == (str(tmp_path), "tight", 0.33, None)
    assert (args.users, args.document_tokens, args.policies, args.budgets) == (6, 2500, "topk:attn,snapkv", "0.25")
    assert (args.scopes, args.block_size, args.server_arg) == ("request,block", 1024, ["--dtype=float32"])
    assert args.name == "gemma3_270m_local_layers" != local_layers.NAME  # the tiny model's pages are kept
    args = sglang_client.build_parser().parse_args(local_layers.driver_argv(tmp_path, local_layers.REAL_CLIENT, []))
    assert (args.policies, args.scopes, args.block_size, args.server_arg) == ("topk:attn", "request,block", 1024, ["--dtype=float32"])
    assert args.name == "gemma3_270m_local_layers_client" and args.system_prompt_tokens == 1500
    # the pool holds about a third of the client's distinct tokens (shared system prompts + every chat's turns)
    distinct = args.groups * args.system_prompt_tokens + args.groups * args.prompts_per_group * args.turns * (
        args.question_tokens + args.output_tokens)
    assert 0.25 <= args.pool_tokens / distinct <= 0.4 and args.pool_tokens > args.system_prompt_tokens + 2 * args.question_tokens


def test_main_serves_the_chat_copy_with_the_real_defaults(tmp_path, monkeypatch):
    import sgl_kvevict.models

    calls = []
    monkeypatch.setattr(sgl_kvevict.models, "resolve_model", lambda name, **_: tmp_path / name)
    monkeypatch.setattr(local_layers, "chat_folder", lambda source: tmp_path / f"{source.name}-chat")
    monkeypatch.setattr(local_layers, "model_folder", lambda: tmp_path / "tiny")
    monkeypatch.setattr(sglang_client, "main", lambda argv: calls.append(("client", argv)) or 0)
    monkeypatch.setattr(multiturn, "main", lambda argv: calls.append(("multiturn", argv)) or 0)
    assert local_layers.main(["client", "--model", "gemma3-270m", "--pool-tokens", "4000"]) == 0
    assert calls[-1] == ("client", local_layers.driver_argv(tmp_path / "gemma3-270m-chat", local_layers.REAL_CLIENT, ["--pool-tokens", "4000"]))
    assert local_layers.main(["multiturn", "--model=gemma3-270m", "--out", str(tmp_path)]) == 0
    assert calls[-1] == ("multiturn", ["compare", "--model", str(tmp_path / "gemma3-270m-chat"), *local_layers.REAL_MULTITURN, "--out", str(tmp_path)])
    assert local_layers.main(["client"]) == 0  # default: the tiny random model, its defaults
    assert calls[-1] == ("client", local_layers.driver_argv(tmp_path / "tiny", local_layers.CLIENT, []))
