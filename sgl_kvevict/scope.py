"""Scope: which segments of a prompt become compressed radix nodes, and who can reuse them.

* ``RequestScope``: a request compresses its own new prompt tokens (everything after the prefix it
  matched) as one segment scored by its own last ``window`` tokens, which stay dense: the next chat
  turn of the same conversation starts with them and reuses the segment.
* ``BlockScope(block_size)``: prompts are compressed in blocks ``[k B, (k + 1) B)`` aligned at
  position 0, each scored by the last ``window`` tokens inside it (kept in the block), so a block
  depends only on the tokens up to its end and every request that starts with the same tokens
  reuses it, whatever comes after.

Both engines (the SGLang tree and the reference engine's schedules) ask the scope, so they compress
the same segments. Pure Python.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

from sgl_kvevict.settings import ConfigError


class Scope(abc.ABC):
    name: ClassVar[str]
    # Whether the segment's observation window is left out of the compressed node (request scope: the
    # next turn continues from it) or compressed with it (a block holds its own window).
    window_stays_dense: ClassVar[bool]

    @abc.abstractmethod
    def compressible_segments(self, start: int, end: int, window: int) -> list[tuple[int, int]]:
        """The segments ``[a, b)`` compressed when a prompt's own tokens ``[start, end)`` are prefilled
        (``[0, start)`` is the prefix it reused)."""

    @staticmethod
    def parse(name: str, block_size: int | None = None) -> "Scope":
        if name == RequestScope.name:
            if block_size is not None:
                raise ConfigError(f"block size {block_size}: only in block scope")
            return RequestScope()
        if name == BlockScope.name:
            return BlockScope(DEFAULT_BLOCK_SIZE if block_size is None else block_size)
        raise ConfigError(f"scope {name!r} is not one of {', '.join(SCOPE_NAMES)}")


@dataclass(frozen=True)
class RequestScope(Scope):
    name: ClassVar[str] = "request"
    window_stays_dense: ClassVar[bool] = True

    def compressible_segments(self, start: int, end: int, window: int) -> list[tuple[int, int]]:
        """The request's own tokens as one segment, when they hold more than the window."""
        return [(start, end)] if end - start > window else []

    def __str__(self) -> str:
        return "request scope"


@dataclass(frozen=True)
class BlockScope(Scope):
    name: ClassVar[str] = "block"
    window_stays_dense: ClassVar[bool] = False
    block_size: int = 512

    def __post_init__(self):
        if self.block_size < 1:
            raise ConfigError(f"block size {self.block_size} must be a positive number of tokens")

    def compressible_segments(self, start: int, end: int, window: int) -> list[tuple[int, int]]:
        """The full blocks inside ``[start, end - 1)``. Blocks starting before ``start`` hold tokens
        the tree already owns. The prompt's last token never joins a block: SGLang always recomputes
        at least one prompt token, so a repeated prompt then reuses every block of it (a block ending
        at the prompt end could never be matched whole)."""
        size = self.block_size
        first = -(-start // size)
        last = (end - 1) // size
        return [(k * size, (k + 1) * size) for k in range(first, last)]

    def __str__(self) -> str:
        return f"block scope, {self.block_size}-token blocks"


DEFAULT_BLOCK_SIZE = BlockScope.block_size
SCOPE_NAMES = (RequestScope.name, BlockScope.name)
