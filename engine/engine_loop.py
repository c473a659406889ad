"""Runs an LLMEngine on its own thread: commands in through a queue, outputs out by callback.

Workers (prefill, decode, colocated) all drive their engine this way, so the engine
itself stays single-threaded and free of any transport.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from engine.llm_engine import (
    EngineDeadError,
    EngineOutput,
    EngineStepError,
    LLMEngine,
    StepLayerHook,
)
from engine.scheduler import step_work

log = logging.getLogger(__name__)

Command = Callable[[LLMEngine], Any]
OutputSink = Callable[[list[EngineOutput]], None]


class EngineLoop:
    """Owns the engine thread.

    Args:
        engine: the engine; only the loop thread touches it once started.
        on_outputs: receives every step's outputs (one call per step), on the loop thread.
        layer_hook: passed to every `engine.step` (KV streaming in the prefill role); a
            role change replaces it on the loop thread.
        on_dead: called (on the loop thread) instead of sending the failed step's outputs
            when the engine can compute no more (`EngineDeadError`: a tensor-parallel rank
            died); None: its requests end with error, as for any failed step.
    """

    def __init__(self, engine: LLMEngine, on_outputs: OutputSink,
                 layer_hook: StepLayerHook | None = None,
                 on_dead: Callable[[EngineDeadError], None] | None = None) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self.layer_hook = layer_hook
        self._commands: queue.SimpleQueue[tuple[Command, Future | None]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.busy_seconds = 0.0
        # Idle time while requests waited for remote KV (decode role): the transfer's cost.
        self.transfer_wait_seconds = 0.0
        self.num_steps = 0
        # Cumulative step time by the shape of the step (`record_step`): what the planner
        # calibrates its step models on, from the steps a serving worker really ran.
        self.step_totals: dict[str, list[float]] = {}

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._commands.put((lambda _engine: None, None))
        self._thread.join(timeout)

    def submit(self, command: Command) -> None:
        """Run `command(engine)` on the loop thread before its next step (fire and forget)."""
        self._commands.put((command, None))

    @property
    def num_pending(self) -> int:
        """Commands waiting for the loop thread (they run, in order, before its next step)."""
        return self._commands.qsize()

    def call(self, command: Command, timeout: float = 60.0) -> Any:
        """Run `command(engine)` on the loop thread and return its result (or raise)."""
        result: Future = Future()
        self._commands.put((command, result))
        return result.result(timeout)

    def _run(self) -> None:
        while not self._stopped.is_set():
            idle = not self.engine.has_unfinished_requests()
            waiting_for_kv = idle and self.engine.num_waiting_for_kv() > 0
            start = time.perf_counter()
            self._drain(block=idle)
            if waiting_for_kv:
                self.transfer_wait_seconds += time.perf_counter() - start
            if self._stopped.is_set() or not self.engine.has_unfinished_requests():
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step(self.layer_hook)
            except EngineDeadError as e:
                if self._on_dead is not None:
                    self._on_dead(e)
                    return
                log.exception("engine dead; its requests end with error")
                outputs = e.outputs
            except EngineStepError as e:
                log.exception("engine step failed; its requests end with error")
                outputs = e.outputs
            elapsed = time.perf_counter() - start
            self.busy_seconds += elapsed
            self.num_steps += 1
            record_step(self.step_totals, self.engine.last_step, elapsed)
            if outputs:
                self._on_outputs(outputs)

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, command: Command, result: Future | None) -> None:
        try:
            value = command(self.engine)
        except Exception as e:
            if result is None:
                log.exception("engine command failed")
            else:
                result.set_exception(e)
            return
        if result is not None:
            result.set_result(value)


def record_step(totals: dict[str, list[float]], items: list[tuple[int, int, bool]],
                seconds: float) -> None:
    """Add one step to cumulative totals keyed by its shape.

    A step with prompt tokens adds to `prompt`: [steps, seconds, squared seconds, tokens,
    query x key pairs, requests] (`step_work`); a decode-only step of batch `b` adds to
    `decode_<b>`: [steps, seconds, squared seconds, tokens attended to]. Differences of two
    snapshots give the mean step of each shape over the window between them, and its
    spread.
    """
    if not items:
        return
    if any(is_prompt for _, _, is_prompt in items):
        key, work = "prompt", step_work(items)
    else:
        key, work = f"decode_{len(items)}", (sum(start + n for start, n, _ in items),)
    total = totals.setdefault(key, [0.0] * (3 + len(work)))
    for i, value in enumerate((1, seconds, seconds * seconds, *work)):
        total[i] += value
