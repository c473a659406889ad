"""The front door's line per finished request (the process's format: `protocol.logs`).

The request line (logger `pdcluster.requests`, level INFO) carries `request_id`, `trace_id`
(when the client sent a W3C `traceparent`), `model`, `status` (the finish reason),
`prompt_tokens`, `output_tokens`, `cached_tokens`, `queue_s`, `ttft_s`, `tpot_s`, `e2e_s`
and `workers`, and never the prompt or the output text.
"""

from __future__ import annotations

import logging
from typing import Any

REQUEST_LOGGER = "pdcluster.requests"


def log_request(fields: dict[str, Any]) -> None:
    """The finished request's line: `finished`, with `fields` as the request's (after the
    message in the text format, top-level keys in the JSON one)."""
    logging.getLogger(REQUEST_LOGGER).info("finished", extra={"request": fields})
