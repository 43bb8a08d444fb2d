"""structlog setup shared by every tokend process: one JSON object per line on stderr.

Libraries that log through the standard library (uvicorn, grpc) get the same JSON lines, so an operator's
log pipeline parses every line the daemon writes. Never log an API key or prompt text at info level; request
ids are what ties a request's lines together: code that handles one request binds its id once
(`structlog.contextvars.bind_contextvars(request_id=...)`, or `bound_contextvars` around the work) and every line
logged in that task, and in the tasks it starts, carries it.
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
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    _route_library_logs(process, numeric_level, timestamper)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,  # what the code handling a request bound: its request_id
            _tag_process(process),
            structlog.processors.add_log_level,
            timestamper,
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


def _tag_process(process: str):
    """Every line names its process, also those of a logger got without binding it (the model loader's)."""

    def tag(_logger, _method, event_dict: dict) -> dict:
        event_dict.setdefault("process", process)
        return event_dict

    return tag


def _route_library_logs(process: str, level: int, timestamper) -> None:
    """Renders standard-library records (uvicorn's, grpc's) as the same JSON lines, tagged with their logger."""

    def tag_process(_logger, _method, event_dict: dict) -> dict:
        return {"process": process, **event_dict}

    handler = logging.StreamHandler(sys.stderr)  # a StreamHandler writes a record and its newline at once
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                tag_process,
                structlog.stdlib.add_logger_name,
                structlog.stdlib.add_log_level,
                timestamper,
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    logging.basicConfig(handlers=[handler], level=level, force=True)
    logging.captureWarnings(True)  # a library's warnings too, not bare text between the records
