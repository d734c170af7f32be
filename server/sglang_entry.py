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
    add_stats_route(app, ServingConfig.from_env())
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
