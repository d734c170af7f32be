"""The router process of a scale-out launch: SGLang's Rust router from ``sglang-router``, with the
router's own command-line flags (``python -m sgl_kvevict.server.router_entry --help``).

``sglang_router.launch_router`` imports its debugging load balancer, which imports ``sglang``; on a
machine without CUDA that import needs the CPU development mode and costs seconds and hundreds of
MB for nothing the router uses. This entry builds the same ``RouterArgs`` and starts the same
``Router`` without it. It also serves a multi-machine set-up as is: give it the workers' URLs.
"""

import argparse
import sys


def router_parser() -> argparse.ArgumentParser:
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="python -m sgl_kvevict.server.router_entry")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return parser


def main(argv: list[str]) -> None:
    from sglang_router.router import Router
    from sglang_router.router_args import RouterArgs

    Router.from_args(RouterArgs.from_cli_args(router_parser().parse_args(argv), use_router_prefix=False)).start()


if __name__ == "__main__":
    main(sys.argv[1:])
