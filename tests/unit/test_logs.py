"""The log format every process shares (`protocol.logs`): a record about a request carries
its fields as JSON keys or `key=value` text, and a worker's `RequestTraces` gives every such
record, wherever in the process it was logged, the client's request id, the attempt and the
trace id of the request it holds."""

from __future__ import annotations

import io
import json
import logging
import warnings

from protocol.logs import RequestTraces, configure_logging, request_log
from protocol.messages import attempt_id, split_attempt_id
from protocol.tracing import trace_id

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


def test_trace_ids_of_w3c_traceparents():
    assert trace_id(TRACEPARENT) == TRACE
    assert trace_id(f"00-{TRACE}-00f067aa0ba902b7-01-future-fields") == TRACE
    for bad in (None, "", "00-not-a-trace-01", f"00-{TRACE.upper()}-00f067aa0ba902b7-01",
                f"00-{'0' * 32}-00f067aa0ba902b7-01", f"00-{TRACE}-{'0' * 16}-01",
                f"ff-{TRACE}-00f067aa0ba902b7-01"):
        assert trace_id(bad) is None, bad


def test_attempt_ids_split_back_into_the_clients_id():
    assert split_attempt_id(attempt_id("chat-1", 2)) == ("chat-1", 2)
    assert split_attempt_id(attempt_id("me@example.com", 1)) == ("me@example.com", 1)
    assert split_attempt_id("me@example.com") == ("me@example.com", None)
    assert split_attempt_id("plain") == ("plain", None)


def test_a_workers_records_carry_the_trace_of_the_request_they_are_about(root_logging):
    out = io.StringIO()
    traces = RequestTraces()
    configure_logging("DEBUG", "json", out, filters=[traces])
    traces.add("req-1@1", TRACEPARENT)
    traces.add("req-2@1", None)  # the client sent none
    # As the engine and the roles log: only the id the worker knows the request by.
    logging.getLogger("engine.llm_engine").info("preempted", extra={"request": {
        "request_id": "req-1@1"}})
    logging.getLogger("decode_worker.role").warning("failed: %s", "boom",
                                                    extra=request_log("req-2@1"))
    logging.getLogger("cluster.worker").info("not about a request")
    traces.keep({"req-2@1"})  # req-1 ended
    logging.getLogger("decode_worker.role").info("late", extra=request_log("req-1@1"))
    preempted, failed, plain, late = (json.loads(line) for line in out.getvalue().splitlines())
    assert {k: preempted[k] for k in ("level", "logger", "message", "request_id", "attempt",
                                      "trace_id")} == {
        "level": "INFO", "logger": "engine.llm_engine", "message": "preempted",
        "request_id": "req-1", "attempt": 1, "trace_id": TRACE}
    assert (failed["message"], failed["request_id"], failed["attempt"]) == \
        ("failed: boom", "req-2", 1)
    assert "trace_id" not in failed and "request_id" not in plain
    assert late["request_id"] == "req-1" and "trace_id" not in late  # forgotten


def test_text_lines_carry_the_same_fields_readably(root_logging):
    out = io.StringIO()
    traces = RequestTraces()
    configure_logging("INFO", "text", out, filters=[traces])
    traces.add("req-1@2", TRACEPARENT)
    try:
        raise RuntimeError("the step failed")
    except RuntimeError:
        logging.getLogger("cluster.worker").error("Generate failed", exc_info=True,
                                                  extra=request_log("req-1@2"))
    first, *traceback = out.getvalue().splitlines()
    assert first.endswith(f" ERROR cluster.worker: Generate failed request_id=req-1 "
                          f"trace_id={TRACE} attempt=2")
    assert traceback[-1] == "RuntimeError: the step failed"


def test_a_traceback_stays_inside_one_json_line(root_logging):
    out = io.StringIO()
    configure_logging("INFO", "json", out)
    try:
        raise ValueError("line one\nline two")
    except ValueError:
        logging.getLogger("x").exception("failed", extra=request_log("r", TRACEPARENT))
    (line,) = out.getvalue().splitlines()
    record = json.loads(line)
    assert (record["request_id"], record["trace_id"]) == ("r", TRACE)
    assert record["exception"].endswith("ValueError: line one\nline two")


def test_a_python_warning_is_a_json_line_too(root_logging):
    """What a library warns (a worker's stderr is its log file) keeps the file one JSON
    object per line."""
    out = io.StringIO()
    configure_logging("INFO", "json", out)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a deprecated thing", DeprecationWarning, stacklevel=1)
    (line,) = out.getvalue().splitlines()
    record = json.loads(line)
    assert (record["level"], record["logger"]) == ("WARNING", "py.warnings")
    assert "DeprecationWarning: a deprecated thing" in record["message"]
