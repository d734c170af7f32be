"""A minimal OpenAI-compatible streaming client (aiohttp) that times each request, and a sampler of
``GET /kvevict/stats``.

Streaming is the only way to see time to first token; ``stream_options.include_usage`` makes the
server send a final usage chunk with ``prompt_tokens_details.cached_tokens`` (the launcher always
passes ``--enable-cache-report``), which is how the prefix-cache hit rate is measured.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import aiohttp

from sgl_kvevict.measure.servers import ServerError

STATS_PATH = "/kvevict/stats"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass
class StreamedReply:
    """What one streamed request returned; ``error`` is set when it did not complete."""

    text: str = ""
    ttft: Optional[float] = None  # seconds from sending to the first content token
    latency: Optional[float] = None  # seconds from sending to the end of the stream
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    content_chunks: int = 0
    token_times: list[float] = field(default_factory=list)  # seconds from sending to each content chunk
    done: bool = False  # the stream ended with ``data: [DONE]``
    status: Optional[int] = None
    error: Optional[str] = None
    problems: list[str] = field(default_factory=list)  # well-formedness violations, see check_reply


def check_reply(reply: StreamedReply, max_tokens: int) -> list[str]:
    """Why a completed reply is not well-formed (empty when it is)."""
    problems = []
    if not reply.done:
        problems.append("stream did not end with [DONE]")
    if reply.finish_reason not in ("stop", "length"):
        problems.append(f"finish_reason {reply.finish_reason!r}")
    if reply.prompt_tokens is None or reply.completion_tokens is None or reply.cached_tokens is None:
        problems.append("no usage chunk with prompt, completion and cached tokens")
    else:
        if reply.prompt_tokens < 1:
            problems.append(f"prompt_tokens {reply.prompt_tokens}")
        if not 0 <= reply.cached_tokens <= reply.prompt_tokens:
            problems.append(f"cached_tokens {reply.cached_tokens} outside [0, prompt_tokens {reply.prompt_tokens}]")
        if not 0 <= reply.completion_tokens <= max_tokens:
            problems.append(f"completion_tokens {reply.completion_tokens} outside [0, max_tokens {max_tokens}]")
        if reply.finish_reason == "length" and reply.completion_tokens != max_tokens:
            problems.append(f"finish_reason length after {reply.completion_tokens} of {max_tokens} tokens")
    return problems


def _apply_chunk(reply: StreamedReply, chunk: dict, started: float) -> None:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        content = delta.get("content") if "delta" in choice else choice.get("text")
        if content:
            reply.token_times.append(time.perf_counter() - started)
            if reply.ttft is None:
                reply.ttft = reply.token_times[0]
            reply.text += content
            reply.content_chunks += 1
        if choice.get("finish_reason"):
            reply.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if usage:
        reply.prompt_tokens = usage.get("prompt_tokens")
        reply.completion_tokens = usage.get("completion_tokens")
        reply.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict,
    abort_after_chunks: Optional[int] = None,
    abort_after_seconds: Optional[float] = None,
    on_token: Optional[Callable[[float], None]] = None,
) -> StreamedReply:
    """POST a streaming (chat) completion and read it to the end.

    ``abort_after_chunks``: close the connection once that many content chunks arrived (a client
    that gives up mid-decode). ``abort_after_seconds``: close it that long after sending if no token
    arrived yet (a client that gives up mid-prefill). An aborted reply has ``error`` starting with
    ``aborted``. ``on_token(seconds)``: called as each content chunk arrives, with its time since
    sending (a caller that acts mid-stream, e.g. sends another request once N tokens are out).
    """
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    reply = StreamedReply()
    started = time.perf_counter()
    try:
        try:
            # SGLang sends a stream's headers with its first chunk, so a client giving up mid-prefill
            # gives up while waiting for them.
            response = await asyncio.wait_for(session.post(url, json=payload), abort_after_seconds)
        except asyncio.TimeoutError:
            if abort_after_seconds is None:
                raise
            reply.error = "aborted before the first token"
            return reply
        async with response:
            reply.status = response.status
            if response.status != 200:
                reply.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return reply
            lines = response.content.__aiter__()
            any_data = False  # the server sends its first chunk once prefill is done
            while True:
                timeout = None
                if abort_after_seconds is not None and not any_data:
                    timeout = max(0.0, abort_after_seconds - (time.perf_counter() - started))
                try:
                    raw = await asyncio.wait_for(lines.__anext__(), timeout)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    response.close()
                    reply.error = "aborted before the first token"
                    return reply
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    reply.done = True
                    break
                any_data = True
                chunk = json.loads(data)
                if "error" in chunk:
                    reply.error = f"error in stream: {str(chunk['error'])[:300]}"
                    return reply
                chunks_before = reply.content_chunks
                _apply_chunk(reply, chunk, started)
                if on_token is not None and reply.content_chunks > chunks_before:
                    on_token(reply.token_times[-1])
                if abort_after_chunks is not None and reply.content_chunks >= abort_after_chunks:
                    response.close()
                    reply.error = f"aborted after {reply.content_chunks} tokens"
                    return reply
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as error:
        reply.error = f"{type(error).__name__}: {error}"
        return reply
    reply.latency = time.perf_counter() - started
    reply.problems = check_reply(reply, payload["max_tokens"])
    return reply


def numeric_fields(stats: dict, prefix: str = "") -> dict[str, float]:
    """The numbers in a ``/kvevict/stats`` answer, nested objects flattened to ``outer.inner`` names
    (the engine's fields change as it grows; the benchmark shows whatever numbers it reports)."""
    numbers: dict[str, float] = {}
    for name, value in stats.items():
        if isinstance(value, dict):
            numbers.update(numeric_fields(value, f"{prefix}{name}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers[prefix + name] = value
    return numbers


@dataclass
class StatsPeaks:
    """``/kvevict/stats`` over a run: the last answer, and the peak and low of each numeric field
    (flattened, see ``numeric_fields``); ``available`` is False when the server has no such endpoint."""

    available: bool = False
    samples: int = 0
    peaks: dict[str, float] = field(default_factory=dict)
    last: Optional[dict] = None
    lows: dict[str, float] = field(default_factory=dict)

    def last_numbers(self) -> dict[str, float]:
        return numeric_fields(self.last or {})


class StatsSampler:
    """Polls ``GET /kvevict/stats`` while a run is going and keeps the peaks. The endpoint is optional:
    a first answer other than 200 marks it unavailable and nothing more is polled."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, interval: float = 0.5):
        self.session, self.url, self.interval = session, base_url + STATS_PATH, interval
        self.result = StatsPeaks()
        self._task: Optional[asyncio.Task] = None

    async def sample(self) -> Optional[dict]:
        try:
            async with self.session.get(self.url) as response:
                if response.status != 200:
                    return None
                stats = await response.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError):
            return None
        result = self.result
        result.available, result.samples, result.last = True, result.samples + 1, stats
        for name, value in numeric_fields(stats).items():
            result.peaks[name] = max(result.peaks.get(name, value), value)
            result.lows[name] = min(result.lows.get(name, value), value)
        return stats

    async def start(self) -> None:
        if await self.sample() is not None:
            self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.sample()

    async def stop(self) -> StatsPeaks:
        if self._task is not None:
            self._task.cancel()
            # gather, not try/except CancelledError: a cancellation of this task while it waits must go on.
            await asyncio.gather(self._task, return_exceptions=True)
            await self.sample()
        return self.result


async def get_json(session: aiohttp.ClientSession, url: str) -> Optional[dict]:
    """The JSON at ``url``, or None when it does not answer 200."""
    try:
        async with session.get(url) as response:
            return await response.json() if response.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError):
        return None


async def flush_when_idle(session: aiohttp.ClientSession, base_url: str, timeout: float = 120.0) -> bool:
    """POST /flush_cache until it succeeds: SGLang refuses while aborted requests are still draining."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with session.post(base_url + "/flush_cache") as response:
                if response.status == 200:
                    return True
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(1.0)
    return False


def _answered(reply: StreamedReply, empty_ok: bool) -> StreamedReply:
    if reply.error or reply.problems or (reply.ttft is None and not empty_ok):
        raise ServerError(f"request failed: {reply.error or reply.problems or 'no token streamed'}")
    return reply


async def ask(session: aiohttp.ClientSession, base_url: str, messages: list[dict], max_tokens: int, empty_ok: bool = False) -> StreamedReply:
    """A greedy chat completion, streamed; raises ``ServerError`` unless it completed well-formed with a
    token. ``empty_ok``: a well-formed reply without a token is an answer too (a model continuing a
    reply's given start may end its turn at once; its ``ttft`` is then None)."""
    payload = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if messages[-1]["role"] == "assistant":
        payload["continue_final_message"] = True
    return _answered(await stream_completion(session, base_url + CHAT_PATH, payload), empty_ok)


async def complete(session: aiohttp.ClientSession, base_url: str, token_ids: list[int], max_tokens: int, empty_ok: bool = False) -> StreamedReply:
    """A greedy text completion of ``token_ids`` (a base model's prompt, its BOS included: the server
    adds no special token to token ids), streamed; the checks of ``ask``."""
    payload = {"model": "default", "prompt": token_ids, "max_tokens": max_tokens, "temperature": 0}
    return _answered(await stream_completion(session, base_url + COMPLETIONS_PATH, payload), empty_ok)
