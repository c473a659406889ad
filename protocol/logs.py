"""One log format for every process of the cluster: the front door's and each worker's.

`configure_logging(level, "json")` makes every record one JSON object per line (`time`,
`level`, `logger`, `message`, and the fields of the request it is about at the top level),
for log shippers; `"text"` is one readable line, the request's fields after the message as
`key=value`. A record is about a request when it carries `extra=request_log(...)`
(`{"request": {"request_id": ..., ...}}`): its `request_id` and, when the request came with
a W3C `traceparent`, its 32-hex `trace_id`, the key that joins the lines of one request
across the front door and the workers (and its spans, with tracing on).

`serve` hands its `--log-level` and `--log-format` to every worker as a `LogConfig`
(`ClusterConfig.log`, `WorkerSpec.log`). A worker knows a request by the router's attempt
id (`<request id>@<attempt>`, `protocol.messages`); its `RequestTraces` filter turns that
into the client's `request_id` and the `attempt`, and adds the `trace_id` of every request
the worker holds, so a record logged anywhere in the worker (role, engine, KV transfer) with
just the id it knows carries the trace.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, TextIO

from protocol.messages import split_attempt_id
from protocol.tracing import trace_id

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")
LogFormat = Literal["text", "json"]

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class LogConfig:
    """A process's log level and format (`serve --log-level`, `--log-format`).

    Args:
        level: `DEBUG`, `INFO`, `WARNING`, `ERROR` or `CRITICAL` (any case).
        format: `text` or `json`.

    Raises:
        ValueError: an unknown level or format; the message lists the choices.
    """

    level: str = "INFO"
    format: LogFormat = "text"

    def __post_init__(self) -> None:
        if self.level.upper() not in LOG_LEVELS:
            raise ValueError(f"log level: {self.level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.format not in LOG_FORMATS:
            raise ValueError(f"log format: {self.format!r} is not one of "
                             f"{', '.join(LOG_FORMATS)}")
        object.__setattr__(self, "level", self.level.upper())


class JsonFormatter(logging.Formatter):
    """One JSON object per record; the request's fields (`extra={"request": {...}}`) are
    top-level keys. Newlines (a traceback's) stay inside the JSON string."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        body.update(getattr(record, "request", {}))
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, then the request's fields as `key=value`."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = getattr(record, "request", None)
        if not fields:
            return line
        return line + " " + " ".join(f"{key}={_text(value)}" for key, value in fields.items())


def configure_logging(level: str = "INFO", fmt: LogFormat = "text",
                      stream: TextIO | None = None,
                      filters: Iterable[logging.Filter] = ()) -> None:
    """Set the root logger's level and its one handler's format (replacing any handler);
    Python's warnings become records of the `py.warnings` logger in that format too.

    Args:
        level: `DEBUG`, `INFO`, `WARNING`, `ERROR` or `CRITICAL` (any case).
        fmt: `text` or `json`.
        stream: where records go; default stderr.
        filters: filters on the handler, so they see every record of the process (a
            worker's `RequestTraces`).

    Raises:
        ValueError: an unknown level or format; the message lists the choices.
    """
    config = LogConfig(level, fmt)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if config.format == "json" else TextFormatter())
    for log_filter in filters:
        handler.addFilter(log_filter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level)
    logging.captureWarnings(True)


def request_log(request_id: str, traceparent: str | None = None,
                **fields: object) -> dict[str, dict[str, object]]:
    """`extra` for a record about one request.

    Args:
        request_id: the request's id, as the logging process knows it.
        traceparent: its W3C `traceparent`; a valid one adds `trace_id`.
        fields: more of the request's fields (None values are left out).
    """
    request: dict[str, object] = {"request_id": request_id}
    trace = trace_id(traceparent)
    if trace is not None:
        request["trace_id"] = trace
    request.update((key, value) for key, value in fields.items() if value is not None)
    return {"request": request}


class RequestTraces(logging.Filter):
    """A worker's requests by the attempt id it knows them by, and their `traceparent`.

    On the worker's log handler, it rewrites every record about a request (`request_log`):
    `request_id` becomes the client's and `attempt` its attempt number, and a request the
    worker holds gets its `trace_id`. `add` on the engine thread as a command arrives,
    `keep` there too (the worker prunes what ended every stats interval); the filter only
    reads, from any thread.
    """

    def __init__(self) -> None:
        super().__init__()
        self._traceparents: dict[str, str] = {}

    def add(self, request_id: str, traceparent: str | None) -> None:
        """Remember a request's `traceparent` (a request without one is not kept)."""
        if traceparent:
            self._traceparents[request_id] = traceparent

    def keep(self, request_ids: Collection[str]) -> None:
        """Forget every request not in `request_ids` (those that ended)."""
        for request_id in [r for r in self._traceparents if r not in request_ids]:
            self._traceparents.pop(request_id, None)

    def filter(self, record: logging.LogRecord) -> bool:
        fields = getattr(record, "request", None)
        if not fields or "request_id" not in fields:
            return True
        attempt_id = fields["request_id"]
        request_id, attempt = split_attempt_id(attempt_id)
        record.request = {**request_log(request_id, self._traceparents.get(attempt_id),
                                        attempt=attempt)["request"], **fields,
                          "request_id": request_id}
        return True


def _text(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "-"
    return "-" if value is None else str(value)
