"""One start-up line, instead of one warning per SGLang model module the CPU mode cannot import.

SGLang imports every module of ``sglang.srt.models`` when its model registry loads, and logs
``Ignore import error when loading sglang.srt.models.X: ...`` for each one that fails. In the CPU
mode about 15 fail (they need CUDA-only ops the ``sgl_kernel`` stand-in lacks, or packages such as
``torchaudio`` that the CPU environment does not install); the served model is not among them, or
SGLang would refuse it as unsupported. Those lines read as failures, so ``SkippedModelModules``
swallows them (a filter on the registry's logger) and logs one warning naming the modules instead.

The registry imports its modules in one loop, so the first other log record of the process marks
the end of that loop: the summary is logged just before it (a log record factory sees every record
the process creates, whatever handlers SGLang configures later).
"""

from __future__ import annotations

import logging

REGISTRY_LOGGER = "sglang.srt.models.registry"
SKIP_PREFIX = "Ignore import error when loading "
MODELS_PACKAGE = "sglang.srt.models."

logger = logging.getLogger(__name__)


class SkippedModelModules(logging.Filter):
    """Swallows the import-error warnings of the logger ``registry_logger`` and logs their summary once
    per burst, through the record factory ``next_factory`` wraps."""

    def __init__(self, registry_logger: str, next_factory):
        super().__init__()
        self.registry_logger = registry_logger
        self.next_factory = next_factory
        self.pending: list[str] = []  # model modules skipped since the last summary

    def _is_skip_warning(self, record: logging.LogRecord) -> bool:
        return record.name == self.registry_logger and str(record.msg).startswith(SKIP_PREFIX)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._is_skip_warning(record):
            return True
        module = record.getMessage()[len(SKIP_PREFIX) :].split(":", 1)[0]
        self.pending.append(module.removeprefix(MODELS_PACKAGE))
        return False

    def make_record(self, *args, **kwargs) -> logging.LogRecord:
        record = self.next_factory(*args, **kwargs)
        if self.pending and not self._is_skip_warning(record):
            self._log_summary()
        return record

    def _log_summary(self) -> None:
        skipped, self.pending = self.pending, []  # cleared first: logging the summary makes a record too
        logger.warning(
            "%d SGLang model modules skipped on CPU (they need CUDA ops or packages the CPU development mode "
            "lacks; other models are unaffected): %s",
            len(skipped),
            ", ".join(skipped),
        )


_installed: SkippedModelModules | None = None


def summarise_skipped_model_modules() -> None:
    """Install ``SkippedModelModules`` on SGLang's registry logger, once per process."""
    global _installed
    if _installed is None:
        _installed = SkippedModelModules(REGISTRY_LOGGER, logging.getLogRecordFactory())
        logging.getLogger(REGISTRY_LOGGER).addFilter(_installed)
        logging.setLogRecordFactory(_installed.make_record)
