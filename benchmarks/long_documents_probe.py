"""The long-document questions through the reference engine: a quick proxy of ``benchmarks.long_documents``
for trying allocations, scores and knobs before a server run (minutes instead of an hour).

    python -m benchmarks.long_documents_probe --server "raw=--kv-evict-policy topk --kv-evict-score learned --kv-evict-scope block" \\
        --server "std=--kv-evict-policy topk --kv-evict-score learned --kv-evict-scope block --kv-evict-layer-scale standardised"
    python -m benchmarks.long_documents_probe --lengths 2000 --only locker --server ...     # one kind of fact
    python -m benchmarks.long_documents_probe --questions new-request --server ...          # the document, then the question

The same documents, turns and scoring as ``long_documents`` (``LABEL=FLAGS`` takes the launcher's
eviction flags, parsed by the launcher's own parser; stock, the dense model, always comes first). Per
document and server: turn 1's prompt is prefilled with the segments the server's scope compresses
(``Scope.compressible_segments``: a block-scope prompt's full blocks), the summary is that cache's own
greedy reply, then every question is answered from a copy of the cache holding turn 1, the summary
and the turn-2 template, the question's tokens dense. With ``--questions new-request`` each question's
own prompt (the document, then the question) is prefilled with the full blocks of the prefix it shares
with turn 1 compressed, the rest dense. fp32 on the CPU, one sequence at a time: the
server's bf16 answers differ (docs/methods/kvzip.md compares the two). Prints accuracy per (server,
length) and per fact kind, writes ``<name>.json`` with every answer into ``--out``.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from benchmarks.cli import add_output_args, benchmark_parser
from benchmarks.long_documents import QUESTION_FORMATS
from benchmarks.long_documents import STOCK_LABEL
from benchmarks.long_documents import LongDocumentsConfig
from benchmarks.long_documents import Server
from benchmarks.long_documents import new_request
from benchmarks.long_documents import turn_one
from benchmarks.long_documents import turn_two
from sgl_kvevict.config import build_policy
from sgl_kvevict.measure.chat import model_token_counter, ChatTokens, shared_prefix
from sgl_kvevict.measure.intervals import wilson
from sgl_kvevict.measure.results import write_atomically
from sgl_kvevict.reference.engine import ReferenceEngine
from sgl_kvevict.reference.schedule import Segment
from sgl_kvevict.server.flags import FlagError, parse_args


@dataclass(frozen=True)
class ProbeAnswer:
    server: str
    length: int
    document: int
    question: str
    answer: str
    output: str
    correct: bool
    kept_share: float  # entries kept over the turn-1 prompt + summary tokens, mean over (layer, KV head)


class ProbeServer:
    """A server's eviction flags as the reference engine applies them (``policy`` None: stock)."""

    def __init__(self, server: Server, model: str):
        serving = parse_args(["--model", model, *server.flags]).serving
        self.label = server.label
        self.eviction = serving.eviction
        self.policy = None if self.eviction is None else build_policy(self.eviction)
        self.scope = serving.scope

    def segments(self, prompt_end: int) -> tuple[Segment, ...]:
        if self.policy is None:
            return ()
        return tuple(Segment(a, b) for a, b in self.scope.compressible_segments(0, prompt_end, self.eviction.window))


def greedy(engine: ReferenceEngine, sequence, logits: torch.Tensor, max_tokens: int) -> list[int]:
    output: list[int] = []
    while len(output) < max_tokens:
        token = int(logits.argmax())
        output.append(token)
        if token in engine.eos_token_ids:
            break
        logits = engine.extend(sequence, [token])
    return output


def probe_document(engine: ReferenceEngine, server: ProbeServer, task, length: int, index: int,
                   config: LongDocumentsConfig, only: str, oracle: bool = False,
                   fixed_summary: Optional[str] = None) -> list[ProbeAnswer]:  # fmt: skip
    """``oracle``: the facts' sentences made visible again after compression (``fact_positions``);
    ``fixed_summary``: turn 2 re-sends this text instead of the server's own summary."""
    tokenizer, chat = engine.tokenizer, ChatTokens(engine.tokenizer)
    turn1 = chat.ids(turn_one(task))
    questions = [question for question in task.questions if only in question.question]
    if config.questions == "new-request":
        return [ask_new_request(engine, chat, server, task, turn1, question, length, index, config, oracle)
                for question in questions]  # fmt: skip
    segments = server.segments(len(turn1))
    sequence = engine.new_sequence()
    logits = engine.extend(sequence, turn1, server.policy, segments)
    if oracle:
        sequence.keep_mask.restore(fact_positions(chat, turn_one(task), task))
    # The summary is decoded on a copy: turn 2 re-sends it as text, whose tokens may differ.
    summary = fixed_summary
    if summary is None:
        summary_ids = greedy(engine, copy.deepcopy(sequence), logits, config.summary_tokens)
        summary = tokenizer.decode(summary_ids, skip_special_tokens=True).strip()
    prompts = [chat.ids(turn_two(task, summary, q)) for q in task.questions]
    shared = next((i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1), min(map(len, prompts)))
    engine.extend(sequence, prompts[0][len(turn1):shared])
    kept_share = _kept_share(engine, sequence, segments, shared)
    answers = []
    for question, prompt in zip(task.questions, prompts):
        if question not in questions:
            continue
        branch = copy.deepcopy(sequence)
        output = tokenizer.decode(greedy(engine, branch, engine.extend(branch, prompt[shared:]), config.answer_tokens),
                                  skip_special_tokens=True)  # fmt: skip
        answers.append(ProbeAnswer(server.label, length, index, question.question, question.answer, output,
                                   question.is_correct(output), kept_share))  # fmt: skip
    return answers


def ask_new_request(engine: ReferenceEngine, chat: ChatTokens, server: ProbeServer, task, turn1: list[int], question, length: int,
                    index: int, config: LongDocumentsConfig, oracle: bool) -> ProbeAnswer:  # fmt: skip
    """``--questions new-request``: the document's full blocks of the prefix the question's prompt shares
    with turn 1 compressed (a block's plan depends only on its tokens, so it is the plan turn 1 stored),
    the rest of the prompt dense. A block that turn 1 compressed across the divergence stays dense here."""
    prompt = chat.ids(new_request(task, question))
    shared = shared_prefix(turn1, prompt)
    segments = server.segments(shared)
    sequence = engine.new_sequence()
    engine.extend(sequence, prompt[:shared], server.policy, segments)
    if oracle:
        sequence.keep_mask.restore(fact_positions(chat, new_request(task, question), task))
    logits = engine.extend(sequence, prompt[shared:])
    output = engine.tokenizer.decode(greedy(engine, sequence, logits, config.answer_tokens), skip_special_tokens=True)
    return ProbeAnswer(server.label, length, index, question.question, question.answer, output,
                       question.is_correct(output), _kept_share(engine, sequence, segments, shared))  # fmt: skip


def fact_positions(chat: ChatTokens, messages: list[dict], task) -> torch.Tensor:
    """int64 ``[n]``: the prompt positions of the tokens that overlap the task's fact sentences (its needles)."""
    rendered = chat.render(messages, tokenize=False)
    encoded = chat.tokenizer(rendered, return_offsets_mapping=True, add_special_tokens=False)
    if encoded["input_ids"] != chat.ids(messages):
        raise ValueError("the rendered prompt tokenizes differently from the chat template's ids")
    spans = [(start, start + len(needle.text)) for needle in task.needles for start in [rendered.index(needle.text)]]
    return torch.tensor([i for i, (a, b) in enumerate(encoded["offset_mapping"]) if any(a < end and b > start for start, end in spans)],
                        dtype=torch.int64)  # fmt: skip


def _kept_share(engine: ReferenceEngine, sequence, segments: Sequence[Segment], length: int) -> float:
    """Entries kept over the first ``length`` tokens, mean over (layer, KV head)."""
    dropped = sum(segment.end - segment.start for segment in segments)
    kept = sum(plan.total_kept() for plan in sequence.plans) / (engine.num_layers * engine.num_kv_heads)
    return (kept + length - dropped) / length


def fact_kind(question: str) -> str:
    """The fact kind a question asks about, by its first words (``sgl_kvevict/measure/tasks.py``'s ``FACT_KINDS``)."""
    return " ".join(question.split()[:3])


def report(answers: Sequence[ProbeAnswer]) -> list[str]:
    """One line per (server, length): accuracy [95% interval], kept share, and per fact kind."""
    cells: dict[tuple[str, int], list[ProbeAnswer]] = defaultdict(list)
    for answer in answers:
        cells[(answer.server, answer.length)].append(answer)
    lines = []
    for (server, length), cell in cells.items():
        right = sum(a.correct for a in cell)
        interval = wilson(right, len(cell))
        kinds: dict[str, list[bool]] = defaultdict(list)
        for a in cell:
            kinds[fact_kind(a.question)].append(a.correct)
        per_kind = ", ".join(f"'{kind} ...' {sum(v)}/{len(v)}" for kind, v in sorted(kinds.items()))
        kept = sum(a.kept_share for a in cell) / len(cell)
        lines.append(f"{server} ~{length}: {right}/{len(cell)} [{100 * interval.low:.0f}, {100 * interval.high:.0f}], "
                     f"kept {kept:.2f}; {per_kind}")  # fmt: skip
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = benchmark_parser("long_documents_probe", __doc__)
    parser.add_argument("--server", action="append", default=[], metavar="LABEL=FLAGS",
                        help="a server besides stock: its label and eviction flags (repeatable)")  # fmt: skip
    parser.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    parser.add_argument("--lengths", default="2000,4000,7000", help="document lengths in model tokens")
    parser.add_argument("--documents", type=int, default=7, help="documents per length (default 7)")
    parser.add_argument("--only", default="", help="ask only the questions containing this text (e.g. locker)")
    parser.add_argument("--questions", default=QUESTION_FORMATS[0], choices=QUESTION_FORMATS,
                        help="where each question is asked (long_documents' --questions)")  # fmt: skip
    parser.add_argument("--oracle-keep-facts", action="store_true",
                        help="after compression, make the facts' sentences visible again in every layer and head "
                        "(an oracle: is the loss in what the ranking dropped? their entries are not counted as kept)")  # fmt: skip
    parser.add_argument("--fixed-summary", metavar="TEXT",
                        help="every server's turn 2 re-sends this summary instead of its own (a control: how much "
                        "of a loss comes through the summary's text)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    add_output_args(parser, "long_documents_probe")
    args = parser.parse_args(argv)
    try:
        lengths = tuple(int(length) for length in args.lengths.split(",") if length.strip())
        config = LongDocumentsConfig(
            model=args.model, servers=(Server(STOCK_LABEL, ("--kv-evict-policy", "none")), *map(Server.parse, args.server)),
            lengths=lengths, documents=args.documents, kinds=("facts",), seed=0, summary_tokens=32, answer_tokens=8,
            pool_tokens=max(16384, 1024 + max(lengths, default=0)),  # no pool here; the config checks it
            questions=args.questions,
        )  # fmt: skip
        servers = [ProbeServer(server, args.model) for server in config.servers]
    except (ValueError, FlagError) as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    engine = ReferenceEngine(args.model)
    count_tokens = model_token_counter(args.model)  # long_documents' own: the same documents
    answers: list[ProbeAnswer] = []
    started = time.perf_counter()
    for length in config.lengths:
        for index, task in enumerate(config.tasks(length, count_tokens)):
            for server in servers:
                found = probe_document(engine, server, task, length, index, config, args.only, args.oracle_keep_facts,
                                       args.fixed_summary)  # fmt: skip
                answers += found
                print(f"  {server.label} ~{length} document {index + 1}/{config.documents}: "
                      f"{sum(a.correct for a in found)}/{len(found)} right ({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    lines = report(answers)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    payload = {"command": "python -m benchmarks.long_documents_probe " + " ".join(argv or sys.argv[1:]),
               "servers": [asdict(server) for server in config.servers], "summary": lines,
               "answers": [asdict(answer) for answer in answers]}  # fmt: skip
    write_atomically(path, json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
