"""benchmarks/long_documents.py: the settings it refuses, the turns it sends, the kept share it reports,
and a tiny run through the real launcher (stock and a block-scope policy server) with resume."""

from __future__ import annotations

import json

import psutil
import pytest
import torch

from benchmarks import long_documents
from benchmarks.long_documents import DocumentRecord, LongDocumentsConfig, LongDocumentsError, Server
from benchmarks.results_readme import long_documents_part
from sgl_kvevict.measure.tasks import make_task
from bench_checks import check_resume

STOCK = Server("stock", ("--kv-evict-policy", "none"))


def count_words(text: str) -> int:
    return len(text.split())


def config(**changes) -> LongDocumentsConfig:
    settings = dict(model="m", servers=(STOCK,), lengths=(2000,), documents=2, kinds=("facts",), seed=0,
                    summary_tokens=8, answer_tokens=4, pool_tokens=4096)  # fmt: skip
    return LongDocumentsConfig(**{**settings, **changes})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"servers": (Server("default", ("--kv-evict-policy", "topk")),)}, "first server must be stock"),
        ({"servers": (STOCK, Server("a", ()), Server("a", ()))}, "labels must differ"),
        ({"lengths": (32,)}, "each must be >= 64"),
        ({"kinds": ("nope",)}, "choose from"),
        ({"lengths": (4000,)}, "stock needs every document dense"),
        ({"documents": 0}, "must be >= 1"),
        ({"questions": "later"}, "choose from after-summary, new-request"),
    ],
)
def test_bad_settings_are_refused(changes, message):
    with pytest.raises(LongDocumentsError, match=message):
        config(**changes)


def test_a_server_spec_is_a_label_and_its_flags():
    server = Server.parse("lava 3000=--kv-evict-policy lava --max-total-tokens 3000")
    assert server == Server("lava 3000", ("--kv-evict-policy", "lava", "--max-total-tokens", "3000"))
    with pytest.raises(LongDocumentsError, match="LABEL=FLAGS"):
        Server.parse("--kv-evict-policy lava")


def test_every_question_is_asked_after_the_summary_of_the_same_document():
    task = make_task("facts", seed=3, target_tokens=400, depth=0.5, count_tokens=count_words)
    assert len(task.questions) == 3
    first = long_documents.turn_one(task)
    for question in task.questions:
        second = long_documents.turn_two(task, "A summary.", question)
        assert second[:1] == first  # turn 1 re-sent unchanged: the prefix the server reuses
        assert second[1:] == [{"role": "assistant", "content": "A summary."}, {"role": "user", "content": question.question},
                              {"role": "assistant", "content": question.answer_prefix}]  # fmt: skip
        assert question.answer in task.context and question.answer not in first[0]["content"].replace(task.context, "")


def test_a_new_request_asks_the_question_right_after_the_same_document(tiny_llama_dir):
    task = make_task("facts", seed=3, target_tokens=400, depth=0.5, count_tokens=count_words)
    first = long_documents.turn_one(task)
    chat = long_documents.ChatTokens.for_model(str(tiny_llama_dir))
    for question in task.questions:
        asked = long_documents.question_messages("new-request", task, "A summary.", question)
        assert asked == [{"role": "user", "content": f"{task.context}\n\n{question.question}"},
                         {"role": "assistant", "content": question.answer_prefix}]  # fmt: skip
        later = long_documents.question_messages("after-summary", task, "A summary.", question)
        assert later == long_documents.turn_two(task, "A summary.", question)
        # What the server may reuse: turn 1 whole after the summary; the document (not the instruction) in a new request.
        turn_one_ids = chat.ids(first)
        assert long_documents.shared_prefix(turn_one_ids, chat.ids(later)) == len(turn_one_ids)
        shared = long_documents.shared_prefix(turn_one_ids, chat.ids(asked))
        assert chat.ids(asked)[:shared] == turn_one_ids[:shared]
        shared_text = chat.tokenizer.decode(turn_one_ids[:shared])
        assert task.context in shared_text and question.question not in shared_text and "Summarise" not in shared_text


def test_the_kept_share_counts_slots_against_the_dense_conversation_and_the_ratio_is_per_length():
    held = DocumentRecord(2000, 0, "facts", prompt_tokens=1900, summary="s", summary_tokens=100, ttft=1.0, slots_held=600)
    assert held.kept_share == pytest.approx(0.3)
    assert DocumentRecord(2000, 0, "facts", 1900, "s", 100, 1.0, None).kept_share is None
    cell = lambda successes, share: {"accuracy": {"successes": successes, "n": 10, "value": successes / 10},  # noqa: E731
                                     "kept_share_mean": share}  # fmt: skip
    servers = long_documents.with_ratios([
        {"label": "stock", "pool_tokens": 16384, "summary": {"2000": cell(8, None), "7000": cell(5, None)}},
        {"label": "lava", "pool_tokens": 3000, "summary": {"2000": cell(8, 0.28), "7000": cell(4, 0.29)}},
    ])  # fmt: skip
    assert servers[0]["vs_stock"] is None
    assert servers[1]["vs_stock"] == {"2000": pytest.approx(1.0), "7000": pytest.approx(0.8)}
    rows = long_documents.accuracy_table({"meta": {"config": {"lengths": [2000, 7000]}}, "servers": servers})
    assert rows[0] == "| server | pool | ~2K accuracy | kept | ~7K accuracy | kept |"
    assert rows[3].startswith("| lava | 3000 | 80 [") and "(x1.00) | 0.28 |" in rows[3] and rows[3].endswith("(x0.80) | 0.29 |")


@pytest.mark.server
def test_long_documents_through_the_tiny_server_and_resume(tiny_llama_dir, tmp_path, capsys):
    argv = [
        "--model", str(tiny_llama_dir), "--lengths", "300", "--documents", "1", "--summary-tokens", "4",
        "--answer-tokens", "3", "--pool-tokens", "2048", "--out", str(tmp_path), "--log-dir", str(tmp_path / "logs"),
        "--server", "snapkv=--kv-evict-policy snapkv --kv-evict-budget 0.5 --kv-evict-scope block --kv-evict-block-size 96 --kv-evict-window 16",
    ]  # fmt: skip
    assert long_documents.main(argv) == 0
    assert psutil.Process().children(recursive=True) == []
    report = json.loads((tmp_path / "long_documents.json").read_text())
    stock, policy = report["servers"]
    assert (stock["label"], policy["label"]) == ("stock", "snapkv")
    for server in (stock, policy):
        cell = server["summary"]["300"]
        assert cell["accuracy"]["n"] == 3 and cell["reuse_rate"] == 1.0  # every question reused turn 1 whole
        assert cell["prompt_tokens_median"] > 300
    assert stock["summary"]["300"]["kept_share_mean"] is None
    # half of each full block kept, the tail and the summary dense: well under the dense size, above half
    assert 0.5 < policy["summary"]["300"]["kept_share_mean"] < 0.9
    assert "| snapkv | 2048 |" in (tmp_path / "long_documents.md").read_text()
    part = "\n".join(long_documents_part(report, "Is 25% safe for my long documents?"))
    assert "### Is 25% safe for my long documents?" in part and "its own later turn" in part
    check_resume(long_documents.main, argv, tmp_path / "logs", capsys, ["--documents", "2"])


@pytest.mark.server
def test_new_requests_reuse_the_compressed_document_through_the_tiny_server(tiny_llama_dir, tmp_path):
    argv = [
        "--model", str(tiny_llama_dir), "--lengths", "300", "--documents", "1", "--summary-tokens", "4",
        "--answer-tokens", "3", "--pool-tokens", "2048", "--out", str(tmp_path), "--log-dir", str(tmp_path / "logs"),
        "--questions", "new-request",
        "--server", "snapkv=--kv-evict-policy snapkv --kv-evict-budget 0.5 --kv-evict-scope block --kv-evict-block-size 96 --kv-evict-window 16",
    ]  # fmt: skip
    assert long_documents.main(argv) == 0
    assert psutil.Process().children(recursive=True) == []
    report = json.loads((tmp_path / "long_documents.json").read_text())
    for server in report["servers"]:
        cell = server["summary"]["300"]
        assert cell["accuracy"]["n"] == 3 and cell["reuse_rate"] == 1.0  # every question reused the document
    assert "a new one-turn request" in (tmp_path / "long_documents.md").read_text()
    assert "a new one-turn request" in "\n".join(long_documents_part(report, "Shared documents"))


@pytest.mark.parametrize("questions", ["after-summary", "new-request"])
def test_the_reference_probe_asks_every_question_through_the_servers_compression(tmp_path, questions):
    """``long_documents_probe`` on one short document: stock keeps everything, the block-scope server
    compresses the full blocks of the document (kept share below 1), every question answered by both."""
    from benchmarks import long_documents_probe

    flags = "--kv-evict-policy topk --kv-evict-score learned --kv-evict-scope block --kv-evict-block-size 160 --kv-evict-budget 0.25"
    assert long_documents_probe.main(["--lengths", "400", "--documents", "1", "--server", f"blocks={flags}",
                                      "--questions", questions, "--out", str(tmp_path), "--threads", str(torch.get_num_threads())]) == 0  # fmt: skip
    payload = json.loads((tmp_path / "long_documents_probe.json").read_text())
    by_server = {label: [a for a in payload["answers"] if a["server"] == label] for label in ("stock", "blocks")}
    assert [len(answers) for answers in by_server.values()] == [3, 3]
    assert {a["kept_share"] for a in by_server["stock"]} == {1.0}
    kept = by_server["blocks"][0]["kept_share"]
    assert 0.25 < kept < 0.75  # two 160-token blocks at 25% of ~440-470 tokens, the rest dense
    assert len(payload["summary"]) == 2


def test_the_reference_probe_refuses_bad_flags_before_loading_the_model(capsys):
    from benchmarks import long_documents_probe

    with pytest.raises(SystemExit) as exit_info:
        long_documents_probe.main(["--server", "bad=--kv-evict-policy nope"])
    assert exit_info.value.code == 2 and "nope" in capsys.readouterr().err


def test_the_probes_oracle_makes_exactly_the_fact_sentences_visible_again(reference):
    """``--oracle-keep-facts``: the positions of the needles' tokens, restored in every layer and head
    after a plan that evicted them, and nothing else restored."""
    from benchmarks.long_documents_probe import fact_positions
    from sgl_kvevict.plan import CompressionPlan, LayerPlan

    task = make_task("facts", seed=3, target_tokens=300, depth=0.5, count_tokens=count_words)
    messages = long_documents.turn_one(task)
    chat = long_documents.ChatTokens(reference.tokenizer)
    positions = fact_positions(chat, messages, task)
    prompt = chat.ids(messages)
    text = reference.tokenizer.decode([prompt[i] for i in positions.tolist()])
    assert all(question.answer in text for question in task.questions) and all(n.text in text for n in task.needles)
    sequence = reference.new_sequence()
    with torch.inference_mode():  # as the engine's extend makes and updates the mask
        sequence.keep_mask.reserve(len(prompt))
        sink = LayerPlan.from_heads([torch.tensor([0])] * reference.num_kv_heads)
        sequence.keep_mask.apply(CompressionPlan(0, len(prompt), (sink,) * reference.num_layers))
    sequence.keep_mask.restore(positions)
    for layer in range(reference.num_layers):
        visible = sequence.keep_mask.kept(layer, len(prompt))
        assert torch.equal(torch.nonzero(visible.all(0)).squeeze(1), torch.cat([torch.tensor([0]), positions]))
        assert bool(visible.all(0).eq(visible.any(0)).all())  # every head alike
