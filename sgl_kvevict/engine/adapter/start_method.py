"""The HTTP process's start method for SGLang's children in CPU development mode (``contacts.CONTACTS``).

SGLang sets the ``spawn`` start method in ``engine._set_envs_and_config`` because a CUDA context does not
survive ``fork``. A spawned scheduler or detokenizer re-imports torch, transformers, SGLang and the
plugin: on the 2-core development machines that is most of a server's start (the scheduler's imports
alone take about 10 s there, and the detokenizer's run at the same time on the other core). Without
CUDA nothing forbids ``fork``, and a forked child inherits those modules, the CPU development mode and
the applied hooks. ``fork`` copies only the calling thread, so it is chosen only while this process has
one OS thread: a lock held by any other (an OpenMP pool, a logging handler) would stay locked in the
child. Otherwise, and on every CUDA machine, SGLang's ``spawn`` stands.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from sgl_kvevict.compat import cpu_mode_needed

logger = logging.getLogger(__name__)

FORK_ANNOUNCEMENT = "sgl-kvevict: CPU development mode: SGLang's processes forked, not spawned"


def os_thread_count() -> int:
    """This process's OS threads (native pools included, which ``threading`` does not see)."""
    return len(os.listdir("/proc/self/task"))


def fork_children_on_cpu(result, *args, **kwargs) -> None:
    """After ``engine._set_envs_and_config``, which set ``spawn``: ``fork`` in CPU development mode while
    this process is single-threaded (the module docstring says why)."""
    if not cpu_mode_needed():
        return
    threads = os_thread_count()
    if threads != 1:
        logger.info("sgl-kvevict: SGLang's processes spawned (this process has %d threads, fork copies one)", threads)
        return
    multiprocessing.set_start_method("fork", force=True)
    logger.info(FORK_ANNOUNCEMENT)
