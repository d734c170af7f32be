"""Checks the benchmark tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import pytest


def check_resume(main: Callable[[list[str]], int], argv: Sequence[str], log_dir: Path, capsys, other: Sequence[str]) -> None:
    """After a finished run of ``main`` with ``argv`` (two servers): ``--resume`` keeps both servers from
    its checkpoint and starts nothing, and ``--resume`` with the ``other`` flags, another configuration,
    is refused."""
    logs = sorted(log_dir.iterdir())
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert sorted(log_dir.iterdir()) == logs  # nothing started again
    assert capsys.readouterr().out.count("kept from the checkpoint") == 2
    with pytest.raises(SystemExit):
        main([*argv, "--resume", *other])
    assert "is of another configuration" in capsys.readouterr().err
