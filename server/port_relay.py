"""The public port of a scale-out launch, opened once the router routes to every worker and relayed,
byte for byte, to the router on its loopback port.

SGLang's router (sglang-router 0.3.2) answers ``/health`` (its liveness) as soon as it listens, and
registers its workers afterwards, in a background queue: for about a second every request it gets
answers 503 ``no_available_workers``. A client that polls ``/health`` and then sends a request got
that 503. So the router listens on a free loopback port, the launcher waits until the router lists
every worker as healthy (the router marks a worker healthy last, once its routing policy knows it),
and only then opens ``--host``:``--port`` here. Until then a connection to it is refused, as a
single server's port is while it loads.

Every accepted connection gets a connection of its own to the router, and bytes go both ways as they
arrive: HTTP keep-alive, streamed responses and the router's errors pass unchanged. An end of stream
on one side half-closes the other, as its sender did; an error on either side closes both. One
asyncio loop in a daemon thread of the launcher serves every connection.
"""

from __future__ import annotations

import asyncio
import threading

CHUNK_BYTES = 64 * 1024


class PortRelay:
    """Relays every connection accepted on ``host:port`` to ``target_host:target_port`` until ``close``;
    OSError when ``host:port`` cannot be bound."""

    def __init__(self, host: str, port: int, target_host: str, target_port: int):
        self._target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(self._relay, host, port))
        except OSError:
            self._loop.close()
            raise
        self._thread = threading.Thread(target=self._loop.run_forever, name="port relay", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop listening and end the connections still open."""
        asyncio.run_coroutine_threadsafe(self._shut_down(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _shut_down(self) -> None:
        self._server.close()
        connections = asyncio.all_tasks() - {asyncio.current_task()}
        for connection in connections:
            connection.cancel()
        await asyncio.gather(*connections, return_exceptions=True)

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        writers = [client_writer]
        try:
            target_reader, target_writer = await asyncio.open_connection(*self._target)
            writers.append(target_writer)
            await asyncio.gather(_copy(client_reader, target_writer), _copy(target_reader, client_writer))
        except (OSError, asyncio.CancelledError):
            # The router is gone (it stopped, or is stopping), one side reset, or ``close`` cancelled the
            # task: both connections end, and the task finishes (asyncio's stream callback would log a
            # cancelled one's CancelledError).
            pass
        finally:
            for writer in writers:
                writer.close()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """``reader``'s bytes to ``writer`` as they arrive; its end of stream as a half-close."""
    while chunk := await reader.read(CHUNK_BYTES):
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
