"""The SGLang server process the launcher starts.

SGLang starts its scheduler and detokenizer processes with the ``spawn`` start method, and a spawned
child re-imports the parent's main module (unless it is a ``__main__`` module). This module is that
main module, so the CPU development mode below is active in every SGLang process, before any of them
imports sglang. (In CPU development mode they are forked instead while this process has one thread,
``sgl_kvevict.engine.adapter.start_method``, and inherit the mode.)
"""

import os
import sys

from sgl_kvevict.compat import activate_cpu_mode

activate_cpu_mode()


def main(argv: list[str]) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sgl_kvevict.engine.adapter.contacts import register_http
    from sgl_kvevict.serving import ServingConfig

    load_plugins()
    server_args = prepare_server_args(argv)
    # SGLang serves this module-level app itself with one tokenizer worker (the launcher refuses more
    # with a policy: extra workers re-import the app by path and would lack the route).
    register_http(app, ServingConfig.from_env())
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
