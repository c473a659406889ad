"""Logging for the front door: the process's level and format, and one line per finished request.

`configure_logging(level, "json")` makes every record one JSON object per line (`time`,
`level`, `logger`, `message`, and a request line's fields at the top level), for log
shippers; `"text"` is one readable line. The request line (logger `pdcluster.requests`, level
INFO) carries `request_id`, `model`, `status` (the finish reason), `prompt_tokens`,
`output_tokens`, `cached_tokens`, `queue_s`, `ttft_s`, `tpot_s`, `e2e_s` and `workers`, and
never the prompt or the output text.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

REQUEST_LOGGER = "pdcluster.requests"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LogFormat = Literal["text", "json"]

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record; a request line's fields (`extra={"request": {...}}`)
    are top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        body.update(getattr(record, "request", {}))
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


def configure_logging(level: str = "INFO", fmt: LogFormat = "text",
                      stream: TextIO | None = None) -> None:
    """Set the root logger's level and its one handler's format (replacing any handler).

    Args:
        level: `DEBUG`, `INFO`, `WARNING`, `ERROR` or `CRITICAL` (any case).
        fmt: `text` or `json`.
        stream: where records go; default stderr.

    Raises:
        ValueError: an unknown level or format; the message lists the choices.
    """
    if level.upper() not in LOG_LEVELS:
        raise ValueError(f"log level: {level!r} is not one of {', '.join(LOG_LEVELS)}")
    if fmt not in ("text", "json"):
        raise ValueError(f"log format: {fmt!r} is not one of text, json")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def log_request(fields: dict[str, Any]) -> None:
    """The finished request's line: readable text, and `fields` for the JSON format."""
    text = " ".join(f"{key}={_text(value)}" for key, value in fields.items())
    logging.getLogger(REQUEST_LOGGER).info("finished %s", text, extra={"request": fields})


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "-"
    return "-" if value is None else str(value)
