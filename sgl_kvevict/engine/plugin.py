"""Entry point of the ``sglang.srt.plugins`` group: runs in every SGLang process (scheduler included)."""


def register() -> None:
    """Nothing to register until the engine integration exists; kept cheap (it runs in every process)."""
