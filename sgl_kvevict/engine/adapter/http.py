"""The HTTP process's contacts (``contacts.CONTACTS``, made by ``contacts.register_http``): the stats
route on SGLang's FastAPI app, the refusal of eviction options a server does not serve, a SIGTERM
noticed at once, and no post-warm-up garbage-collector freeze before the HTTP server listens.

A request whose ``extra_key`` names eviction options the server does not serve
(``sgl_kvevict.request_options``) gets HTTP 400 with the one-line reason before it reaches the
scheduler: the check after ``/generate``'s schema check answers as that check does (``{"error":
reason}``, streamed requests included); the one before ``TokenizerManager.generate_request`` covers
every other route, where SGLang turns the ``ValueError`` into its 400 (the OpenAI routes start a
stream only after their first chunk, so streamed chat requests get the 400 too).
"""

from __future__ import annotations

import asyncio

from sgl_kvevict.request_options import RequestOptionsRefused, check_extra_keys
from sgl_kvevict.serving import ServingConfig

STATS_ROUTE = "/kvevict/stats"
# The scheduler answers between two forward passes at worst; a longer wait means it is not serving.
STATS_TIMEOUT_SECONDS = 5.0
SIGTERM_POLL_SECONDS = 0.05


def stats_route(serving: ServingConfig):
    """``GET /kvevict/stats``: the scheduler's compression statistics (fields documented in
    ``sgl_kvevict.engine.stats_channel``), 503 with a reason when the scheduler does not answer, and
    ``{"policy": "none"}`` without a policy (no compressed tree to report on)."""

    def add(app) -> None:
        from fastapi.responses import JSONResponse

        from sgl_kvevict.engine.stats_channel import StatsUnavailable, fetch_stats

        # A plain ``def``: FastAPI runs it on its thread pool, so the blocking fetch never stalls the loop.
        @app.get(STATS_ROUTE)
        def kvevict_stats():
            if not serving.enabled:
                return {"policy": serving.policy}
            try:
                return fetch_stats(STATS_TIMEOUT_SECONDS)
            except StatsUnavailable as error:
                return JSONResponse({"policy": serving.policy, "error": str(error)}, status_code=503)

    return add


def check_generate_body(serving: ServingConfig):
    allow = serving.request_allow_list

    def check(error, body):
        if error is not None or not isinstance(body, dict):
            return error
        try:
            check_extra_keys(body.get("extra_key"), allow)
        except RequestOptionsRefused as refusal:
            return str(refusal)
        return None

    return check


def check_generate_request(serving: ServingConfig):
    allow = serving.request_allow_list

    def check(tokenizer_manager, obj, *args, **kwargs):
        check_extra_keys(getattr(obj, "extra_key", None), allow)

    return check


async def prompt_sigterm_watchdog(original, tokenizer_manager):
    """Around ``TokenizerManager.sigterm_watchdog``: SGLang's looks for the SIGTERM flag every 5 s, so a
    stopped server idled 2.5 s on average (4 s of a 7-s stop of an idle CPU server) before draining; this
    looks every ``SIGTERM_POLL_SECONDS``, then runs SGLang's own, which finds the flag set and drains and
    exits as before (a request in flight still finishes)."""
    while not tokenizer_manager.gracefully_exit:
        await asyncio.sleep(SIGTERM_POLL_SECONDS)
    await original(tokenizer_manager)


def freeze_gc_after_warmup_only(original, server_args):
    """Around ``http_server._freeze_gc_after_server_warmup``: SGLang posts its own ``/freeze_gc`` once its
    warm-up ran, but with ``--skip-server-warmup`` (the CPU default) that post races uvicorn's start, and
    refused it logged a 70-line traceback (in 40 of the 65 server starts of a test run). Without a
    warm-up the launcher freezes the garbage collectors itself once ``/health`` answers
    (``server.processes.freeze_gc``), so SGLang's early post is skipped; after a warm-up SGLang's own
    runs as before."""
    from sglang.srt.runtime_context import get_serving

    if not get_serving().skip_server_warmup:
        original(server_args)
