"""`EngineBackend`: the router's backend over one in-process colocated engine (no Ray)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

import msgspec

from engine import EngineOutput, LLMEngine
from engine.engine_loop import EngineLoop
from protocol import WorkerStatus
from router.backend import Backend, GenerateRequest, ModelInfo, TokenDelta

# The one worker's id, in `status` and in the request log's `workers`.
WORKER_ID = "engine-0"


class EngineBackend(Backend):
    """One colocated engine in this process, driven by an `EngineLoop` thread.

    Args:
        engine: the engine (role `mixed`).
        name: the model name clients use.
    """

    def __init__(self, engine: LLMEngine, name: str) -> None:
        self.engine = engine
        self.name = name
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self.loop = EngineLoop(engine, self._on_outputs)
        self.loop.start()

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.name, str(self.engine.model_dir), self.engine.max_model_len,
                         self.engine.model_config.vocab_size)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        with self._lock:
            self._streams[request.request_id] = (asyncio.get_running_loop(), queue)
        try:
            await asyncio.to_thread(self.loop.call, lambda e: e.add_request(
                request.request_id, request.prompt_token_ids, request.params))
            while True:
                delta = await queue.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            # A consumer that stopped early (client gone) must not leave blocks behind.
            self.loop.submit(lambda e: e.abort_request(request.request_id))

    def _on_outputs(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            with self._lock:
                target = self._streams.get(out.request_id)
            if target is None:
                continue
            loop, queue = target
            delta = TokenDelta(out.request_id, out.new_token_ids, out.finish_reason,
                               out.new_logprobs, out.num_cached_tokens,
                               workers=(WORKER_ID,) if out.finish_reason else ())
            loop.call_soon_threadsafe(queue.put_nowait, delta)

    async def abort(self, request_id: str) -> bool:
        out = await asyncio.to_thread(self.loop.call, lambda e: e.abort_request(request_id))
        if out is not None:
            self._on_outputs([out])
        return out is not None

    async def status(self) -> dict[str, Any]:
        stats = await asyncio.to_thread(self.loop.call, lambda e: e.stats())
        worker = WorkerStatus(**asdict(stats), worker_id=WORKER_ID, role="mixed",
                              pid=os.getpid())
        return {"mode": "engine", "pools": {"mixed": [msgspec.to_builtins(worker)]}}

    async def scale(self, num_prefill: int | None, num_decode: int | None) -> dict[str, Any]:
        raise NotImplementedError("a single in-process engine cannot be resized")

    def healthy(self) -> bool:
        return self.loop.is_alive()

    def close(self) -> None:
        self.loop.stop()
