"""structlog setup shared by every tokend process: one JSON object per line on stderr.

Never log an API key or prompt text at info level; request ids are what ties a request's lines together.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(process: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    """Configures structlog (and the stdlib root logger, for libraries) and returns this process's logger."""
    numeric_level = logging.getLevelNamesMapping().get(level.upper())
    if numeric_level is None:
        raise ValueError(f"log_level: must be one of debug, info, warning, error, got {level!r}")
    logging.basicConfig(stream=sys.stderr, level=numeric_level, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        # One write per record, newline included: every tokend process shares the daemon's stderr (a file or
        # journald's stream), and print() writes the text and its newline separately, so two processes logging
        # at once could splice their lines together.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger().bind(process=process)
