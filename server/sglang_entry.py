"""The SGLang server process the launcher starts.

SGLang spawns its scheduler and detokenizer processes with the ``spawn`` start method, and a spawned
child re-imports the parent's main module (unless it is a ``__main__`` module). This module is that
main module, so the CPU development mode below is active in every SGLang process, before any of them
imports sglang.
"""

import os
import sys

from sgl_kvevict.compat import activate_cpu_mode

activate_cpu_mode()

STATS_ROUTE = "/kvevict/stats"
# The scheduler answers between two forward passes at worst; a longer wait means it is not serving.
STATS_TIMEOUT_SECONDS = 5.0
# Where every generation request passes in this process (the OpenAI routes, /generate), and the
# schema check /generate runs before it starts a response (so a streamed request is refused too).
GENERATE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
GENERATE_CONTRACT = "sglang.srt.entrypoints.api_contract.generate_contract_error"


def add_stats_route(app, serving) -> None:
    """``GET /kvevict/stats``: the scheduler's compression statistics (fields documented in
    ``sgl_kvevict.engine.stats_channel``), 503 with a reason when the scheduler does not answer, and
    ``{"policy": "none"}`` without a policy (no compressed tree to report on)."""
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


def add_request_option_checks(serving) -> None:
    """Refuse, in this (the HTTP) process, a request whose ``extra_key`` names eviction options the
    server does not serve (``sgl_kvevict.request_options``): HTTP 400 with the one-line reason, before
    the request reaches the scheduler. Two hooks through SGLang's ``HookRegistry``: the check after
    ``/generate``'s schema check answers as that check does (``{"error": reason}``, streamed requests
    included); the one before ``TokenizerManager.generate_request`` covers every other route, where
    SGLang turns the ``ValueError`` into its 400 (the OpenAI routes start a stream only after their
    first chunk, so streamed chat requests get the 400 too). Stock SGLang (no policy) is left alone."""
    if not serving.enabled:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_kvevict.request_options import RequestOptionsRefused, check_extra_keys

    allow = serving.request_allow_list

    def check_generate_body(error, body):
        if error is not None or not isinstance(body, dict):
            return error
        try:
            check_extra_keys(body.get("extra_key"), allow)
        except RequestOptionsRefused as refusal:
            return str(refusal)
        return None

    def check_generate_request(tokenizer_manager, obj, *args, **kwargs):
        check_extra_keys(getattr(obj, "extra_key", None), allow)

    HookRegistry.register(GENERATE_CONTRACT, check_generate_body, HookType.AFTER)
    HookRegistry.register(GENERATE_REQUEST, check_generate_request, HookType.BEFORE)
    HookRegistry.apply_hooks()


def main(argv: list[str]) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sgl_kvevict.serving import ServingConfig

    load_plugins()
    server_args = prepare_server_args(argv)
    # SGLang serves this module-level app itself with one tokenizer worker (the launcher refuses more
    # with a policy: extra workers re-import the app by path and would lack the route).
    serving = ServingConfig.from_env()
    add_stats_route(app, serving)
    add_request_option_checks(serving)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
