"""Request dispatch over a fake pool, no Ray and no sockets: the commands each worker gets
(exact ids, exact blocks), the client's stream, retries, migration and spreading, counted
exactly. The workers' side is played by feeding the dispatcher their replies."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from cluster.dispatch import MIN_TOKENS_LEFT_TO_MOVE, DispatchConfig, Dispatcher
from cluster.handle import WorkerHandle
from cluster.metrics import ClusterMetrics
from engine import SamplingParams
from protocol import (
    Abort,
    Command,
    CompatRecord,
    Failed,
    Generate,
    KVPeerInfo,
    Prefill,
    Rejected,
    Reserved,
    Role,
    Step,
    TokenRecord,
    WireSamplingParams,
    WorkerInfo,
)
from protocol.defaults import RESERVE_RETRY_S
from router.backend import GenerateRequest, TokenDelta

BLOCK_BYTES = 4096
LONG = list(range(100, 140))  # 40 tokens: above the threshold, prefilled remotely
SHORT = list(range(100, 106))  # 6 tokens: prefilled on the decode worker
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "congo=t61rcWkgMzE"


def worker_info(worker_id: str, role: Role, num_blocks: int) -> WorkerInfo:
    """What a worker of `role` would report; decode workers have a KV receiver."""
    peer_info = KVPeerInfo(
        receiver_id=f"rx-{worker_id}", endpoint="tcp://10.0.0.9:4000",
        compat=CompatRecord(model="tiny", dtype="float32", block_size=4, num_layers=2,
                            num_kv_heads=2, head_dim=8),
        num_blocks=num_blocks, transports=("zmq",), verify_checksums=False, locality="here")
    return WorkerInfo(worker_id=worker_id, role=role, endpoint="tcp://10.0.0.9:5000",
                      host="10.0.0.9", pid=1, model_dir="/models/tiny", max_model_len=256,
                      vocab_size=256, block_size=4, num_blocks=num_blocks,
                      block_bytes=BLOCK_BYTES, torch_threads=1,
                      peer_info=peer_info if role == Role.DECODE else None)


class FakePool:
    """Workers as handles; what is sent to them is recorded, not delivered."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerHandle] = {}
        self.sent: list[tuple[str, Command]] = []
        self.starting: asyncio.Event | None = None  # set when a worker being started is ready
        self.waiting = asyncio.Event()  # set once a request waits for that worker

    def add(self, worker_id: str, role: Role, num_blocks: int = 64) -> WorkerHandle:
        handle = WorkerHandle(worker_id, role, worker_info(worker_id, role, num_blocks))
        self.workers[worker_id] = handle
        return handle

    async def send(self, handle: WorkerHandle, command: Command) -> None:
        self.sent.append((handle.worker_id, command))

    async def wait_for_worker(self, deadline: float) -> None:
        if self.starting is None:
            raise RuntimeError("no healthy decode worker")
        self.waiting.set()
        await asyncio.wait_for(self.starting.wait(), deadline - time.monotonic())

    def to(self, worker_id: str, kind: type | None = None) -> list[Command]:
        return [c for w, c in self.sent if w == worker_id and (kind is None or
                                                                isinstance(c, kind))]


class Harness:
    """A dispatcher over a fake pool, and a client reading one stream per request."""

    def __init__(self, migrate: bool = True, reserve_timeout_s: float = 5.0,
                 local_prefill_threshold: int = 8, ttft_slo_s: float | None = None) -> None:
        self.pool = FakePool()
        self.metrics = ClusterMetrics("tiny")
        self.dispatcher = Dispatcher(
            self.pool, DispatchConfig(local_prefill_threshold=local_prefill_threshold,
                                      reserve_timeout_s=reserve_timeout_s, migrate=migrate,
                                      block_size=4, ttft_slo_s=ttft_slo_s), self.metrics)
        self.received: dict[str, list[TokenDelta]] = {}
        self.streams: dict[str, asyncio.Task] = {}

    def start(self, request_id: str, prompt: list[int], traceparent: str | None = None,
              tracestate: str | None = None, waited: float = 0.0, **params: Any) -> None:
        """Stream `request_id`, which arrived at the router `waited` seconds ago."""
        params.setdefault("max_tokens", 64)
        request = GenerateRequest(request_id, prompt, SamplingParams(**params),
                                  time.monotonic() - waited, traceparent, tracestate)
        self.received[request_id] = []

        async def read(stream: AsyncIterator[TokenDelta]) -> None:
            async for delta in stream:
                self.received[request_id].append(delta)
        self.streams[request_id] = asyncio.create_task(read(self.dispatcher.generate(request)))

    def reply(self, worker_id: str, message: Any) -> None:
        self.dispatcher.on_message(self.pool.workers[worker_id], message)

    def step(self, worker_id: str, *records: TokenRecord) -> None:
        self.reply(worker_id, Step(worker_id=worker_id, outputs=list(records)))

    def tokens(self, request_id: str) -> list[int]:
        return [t for d in self.received[request_id] for t in d.token_ids]

    def finish(self, request_id: str) -> TokenDelta:
        return self.received[request_id][-1]

    def count(self, name: str) -> float:
        return self.metrics.value(name)


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.001)


def run(scenario: Callable[[Harness], Coroutine[Any, Any, None]], **kwargs: Any) -> Harness:
    harness = Harness(**kwargs)

    async def main() -> None:
        await scenario(harness)
        await asyncio.wait_for(asyncio.gather(*harness.streams.values()), 5)
        harness.dispatcher.close()
    asyncio.run(main())
    return harness


def idle(h: Harness) -> bool:
    return all(not w.in_flight for w in h.pool.workers.values())


async def _prefilling_remotely(h: Harness, request_id: str) -> None:
    """decode-0 and prefill-0; `request_id` (a long prompt) reserved on the one and sent to
    the other."""
    h.pool.add("decode-0", Role.DECODE)
    h.pool.add("prefill-0", Role.PREFILL)
    h.start(request_id, LONG)
    await until(lambda: h.pool.to("decode-0"))
    h.reply("decode-0", Reserved(worker_id="decode-0", request_id=f"{request_id}@1",
                                 dst_block_ids=[1], num_cached_tokens=0))
    await until(lambda: h.pool.to("prefill-0"))


def test_a_long_prompt_reserves_on_decode_then_prefills_remotely() -> None:
    async def scenario(h: Harness) -> None:
        h.pool.add("decode-0", Role.DECODE)
        h.pool.add("prefill-0", Role.PREFILL)
        h.start("r", LONG, TRACEPARENT, TRACESTATE, max_tokens=3)
        await until(lambda: h.pool.to("decode-0"))
        params = WireSamplingParams.from_params(SamplingParams(max_tokens=3))
        assert h.pool.to("decode-0") == [Generate(
            request_id="r@1", prompt_token_ids=LONG, params=params, remote_prefill=True,
            output_token_ids=[], traceparent=TRACEPARENT, tracestate=TRACESTATE)]
        assert h.pool.workers["decode-0"].in_flight == {"r"}
        h.reply("decode-0", Reserved(worker_id="decode-0", request_id="r@1",
                                     dst_block_ids=[3, 4, 9], num_cached_tokens=28))
        await until(lambda: h.pool.to("prefill-0"))
        prefill = h.pool.to("prefill-0")[0]
        assert isinstance(prefill, Prefill)
        assert (prefill.request_id, prefill.prompt_token_ids, prefill.params,
                prefill.dst_block_ids, prefill.num_cached_tokens, prefill.traceparent,
                prefill.tracestate) == ("r@1", LONG, params, [3, 4, 9], 28, TRACEPARENT,
                                        TRACESTATE)
        assert prefill.peer_info == h.pool.workers["decode-0"].info.peer_info
        assert prefill.peer_info.receiver_id == "rx-decode-0"
        assert h.pool.workers["prefill-0"].in_flight == {"r"}
        # The first token arrives on the decode side with the transfer's timings: the
        # prefill worker is done with it.
        h.step("decode-0", TokenRecord(request_id="r@1", token_ids=[7], num_cached_tokens=28,
                                       timings={"prefill": 0.2, "transfer": 0.01},
                                       transport="zmq"))
        await until(lambda: h.tokens("r") == [7])
        assert not h.pool.workers["prefill-0"].in_flight
        h.step("decode-0", TokenRecord(request_id="r@1", token_ids=[8, 9],
                                       finish_reason="length"))

    h = run(scenario)
    assert h.tokens("r") == [7, 8, 9]
    last = h.finish("r")
    assert last.finish_reason == "length" and last.timings == {"prefill": 0.2, "transfer": 0.01}
    assert last.workers == ("decode-0", "prefill-0")  # for the request's log line
    assert h.metrics.registry.get_sample_value(
        "pdcluster:kv_transfer_bytes_total",
        {"model_name": "tiny", "transport": "zmq"}) == 3 * BLOCK_BYTES
    assert h.metrics.registry.get_sample_value(
        "pdcluster:kv_transfer_request_bytes_sum",
        {"model_name": "tiny", "transport": "zmq"}) == 3 * BLOCK_BYTES
    assert h.metrics.registry.get_sample_value(
        "pdcluster:kv_transfer_request_bytes_count",
        {"model_name": "tiny", "transport": "zmq"}) == 1
    assert h.metrics.registry.get_sample_value("pdcluster:kv_transfer_seconds_count",
                                               {"model_name": "tiny"}) == 1
    assert idle(h) and not h.dispatcher.requests
    # A finished request is not aborted.
    assert not [c for _, c in h.pool.sent if isinstance(c, Abort)]


def test_with_a_ttft_objective_each_first_placement_carries_the_time_left_of_it() -> None:
    async def scenario(h: Harness) -> None:
        # Each budget is 2 s less the time since the router took the request: within the
        # clock readings around each step (no bound on how fast this machine runs it).
        t0 = time.monotonic()
        await _prefilling_remotely(h, "far")
        h.start("near", SHORT, waited=1.5)
        t1 = time.monotonic()
        await until(lambda: len(h.pool.to("decode-0", Generate)) == 2)
        t2 = time.monotonic()
        far, near = h.pool.to("decode-0", Generate)
        (prefill,) = h.pool.to("prefill-0", Prefill)
        assert 2.0 - (t1 - t0) <= far.ttft_budget_s <= 2.0
        assert far.ttft_budget_s - (t1 - t0) <= prefill.ttft_budget_s <= far.ttft_budget_s
        assert 0.5 - (t2 - t1) <= near.ttft_budget_s <= 0.5
        # A request whose tokens are already out has no TTFT left to meet when it moves.
        h.step("decode-0", TokenRecord(request_id="near@1", token_ids=[5]))
        await until(lambda: h.tokens("near") == [5])
        h.pool.add("decode-1", Role.DECODE)
        h.pool.workers["decode-0"].state = "dead"
        h.dispatcher.migrate_off(h.pool.workers["decode-0"])
        await until(lambda: len(h.pool.to("decode-1", Generate)) == 2)
        t3 = time.monotonic()
        moved = {c.request_id: c for c in h.pool.to("decode-1", Generate)}
        assert moved["near@2"].output_token_ids == [5] and moved["near@2"].ttft_budget_s is None
        # One with no token yet still has its objective, less the time already spent.
        far2 = moved["far@2"]
        assert far2.output_token_ids == [] and far2.remote_prefill
        assert 2.0 - (t3 - t0) <= far2.ttft_budget_s <= prefill.ttft_budget_s
        h.step("decode-1", TokenRecord(request_id="near@2", token_ids=[6],
                                       finish_reason="length"))
        h.reply("decode-1", Reserved(worker_id="decode-1", request_id="far@2",
                                     dst_block_ids=[2], num_cached_tokens=0))
        await until(lambda: len(h.pool.to("prefill-0", Prefill)) == 2)
        h.step("decode-1", TokenRecord(request_id="far@2", token_ids=[6],
                                       finish_reason="length"))

    h = run(scenario, ttft_slo_s=2.0)
    assert h.tokens("near") == [5, 6] and h.tokens("far") == [6] and idle(h)


def test_a_short_prompt_is_prefilled_where_it_decodes() -> None:
    async def scenario(h: Harness) -> None:
        h.pool.add("decode-0", Role.DECODE)
        h.pool.add("prefill-0", Role.PREFILL)
        h.start("r", SHORT, max_tokens=1)
        await until(lambda: h.pool.to("decode-0"))
        assert h.pool.to("decode-0")[0].remote_prefill is False
        h.step("decode-0", TokenRecord(request_id="r@1", token_ids=[5], finish_reason="length"))

    h = run(scenario)
    assert h.tokens("r") == [5] and not h.pool.to("prefill-0") and idle(h)


def test_a_rejected_reservation_is_placed_again_after_the_retry_interval() -> None:
    """The only decode worker has no blocks for the prompt now. The request is placed
    again after `RESERVE_RETRY_S`: that worker is still preferred (the prefix index holds
    the prompt's blocks there), so the prompt is prefilled on it, where it waits in the
    engine's queue for blocks, rather than reserved again."""
    async def scenario(h: Harness) -> None:
        h.pool.add("decode-0", Role.DECODE)
        h.pool.add("prefill-0", Role.PREFILL)
        h.start("r", LONG, max_tokens=1)
        await until(lambda: h.pool.to("decode-0"))
        asked = time.monotonic()
        h.reply("decode-0", Rejected(worker_id="decode-0", request_id="r@1",
                                     reason="KV full"))
        await until(lambda: len(h.pool.to("decode-0")) == 2)
        assert time.monotonic() - asked >= RESERVE_RETRY_S
        h.step("decode-0", TokenRecord(request_id="r@1", token_ids=[4], finish_reason="length"))

    h = run(scenario)
    first, second = h.pool.to("decode-0", Generate)
    assert (first.request_id, first.remote_prefill) == ("r@1", True)
    assert (second.request_id, second.remote_prefill) == ("r@1", False)  # same attempt
    assert not h.pool.to("prefill-0") and not h.pool.to("decode-0", Abort)
    assert h.tokens("r") == [4] and h.count("migrations") == 0 and idle(h)


def test_a_reservation_that_never_comes_fails_the_request_at_the_reserve_timeout() -> None:
    """Every uncached token goes to a prefill worker (threshold 0) and the decode worker
    rejects every reservation: the request is asked again every `RESERVE_RETRY_S` until
    the reserve timeout, then ends in error with the worker's reason."""
    async def scenario(h: Harness) -> None:
        h.pool.add("decode-0", Role.DECODE)
        h.pool.add("prefill-0", Role.PREFILL)
        h.start("r", [*LONG, 7])  # 41 tokens: one past the last full block, never cached
        rejected = 0
        while not h.streams["r"].done():
            if len(h.pool.to("decode-0", Generate)) > rejected:
                rejected += 1
                h.reply("decode-0", Rejected(worker_id="decode-0", request_id="r@1",
                                             reason="KV full"))
            await asyncio.sleep(0.005)

    h = run(scenario, reserve_timeout_s=1.0, local_prefill_threshold=0)
    asks = h.pool.to("decode-0", Generate)
    assert all(c.request_id == "r@1" and c.remote_prefill for c in asks)
    # Asked at least RESERVE_RETRY_S apart, and once more after each check before the
    # deadline: at most timeout / interval + 2 asks.
    assert 2 <= len(asks) <= round(1.0 / RESERVE_RETRY_S) + 2
    last = h.finish("r")
    assert last.finish_reason == "error"
    assert last.error == "no decode KV blocks freed up in time: KV full"
    assert not h.pool.to("prefill-0") and idle(h) and not h.dispatcher.requests


def test_with_no_decode_worker_a_request_fails_at_once_or_waits_for_a_replacement() -> None:
    async def scenario(h: Harness) -> None:
        h.pool.add("prefill-0", Role.PREFILL)
        h.start("alone", SHORT)
        await until(lambda: h.streams["alone"].done())
        h.pool.starting = asyncio.Event()  # a replacement is being started
        h.start("waits", SHORT, max_tokens=1)
        await h.pool.waiting.wait()
        assert not h.pool.sent  # nothing placed: it waits for the replacement
        h.pool.add("decode-1", Role.DECODE)
        h.pool.starting.set()
        await until(lambda: h.pool.to("decode-1"))
        h.step("decode-1", TokenRecord(request_id="waits@1", token_ids=[3],
                                       finish_reason="stop"))

    h = run(scenario)
    assert h.finish("alone").finish_reason == "error"
    assert h.finish("alone").error == "no healthy decode worker"
    assert h.tokens("waits") == [3] and h.finish("waits").finish_reason == "stop"


def test_a_failed_transfer_is_retried_once_on_another_prefill_worker() -> None:
    async def scenario(h: Harness) -> None:
        h.pool.add("decode-0", Role.DECODE)
        h.pool.add("prefill-0", Role.PREFILL)
        h.start("r", LONG, max_tokens=1)
        await until(lambda: h.pool.to("decode-0"))
        h.reply("decode-0", Reserved(worker_id="decode-0", request_id="r@1",
                                     dst_block_ids=[1, 2], num_cached_tokens=0))
        await until(lambda: h.pool.to("prefill-0"))
        h.pool.add("prefill-1", Role.PREFILL)
        h.reply("prefill-0", Failed(worker_id="prefill-0", request_id="r@1",
                                    error="peer gone", transfer_failed=True))
        await until(lambda: len(h.pool.to("decode-0", Generate)) == 2)
        h.reply("decode-0", Reserved(worker_id="decode-0", request_id="r@2",
                                     dst_block_ids=[5, 6], num_cached_tokens=0))
        await until(lambda: h.pool.to("prefill-1"))
        h.step("decode-0", TokenRecord(request_id="r@2", token_ids=[9], finish_reason="length",
                                       timings={"prefill": 0.1, "transfer": 0.0}))

    h = run(scenario)
    # The first attempt is aborted on both sides; the second goes to the other prefill
    # worker, never back to the one that failed.
    assert h.pool.to("prefill-0", Abort) == [Abort(request_id="r@1")]
    assert Abort(request_id="r@1") in h.pool.to("decode-0", Abort)
    assert [c.dst_block_ids for c in h.pool.to("prefill-1", Prefill)] == [[5, 6]]
    assert len(h.pool.to("prefill-0", Prefill)) == 1
    assert h.tokens("r") == [9]
    assert (h.count("transfer_retries"), h.count("migrations")) == (1, 0)
    assert idle(h)


def test_a_second_failed_transfer_ends_the_request_with_its_error() -> None:
    async def scenario(h: Harness) -> None:
        await _prefilling_remotely(h, "r")
        h.step("decode-0", TokenRecord(request_id="r@1", finish_reason="error",
                                       error="checksum mismatch", transfer_failed=True))
        # No other prefill worker: the retry prefills on the decode worker itself.
        await until(lambda: len(h.pool.to("decode-0", Generate)) == 2)
        assert h.pool.to("decode-0", Generate)[1].remote_prefill is False
        h.step("decode-0", TokenRecord(request_id="r@2", finish_reason="error",
                                       error="checksum mismatch again", transfer_failed=True))

    h = run(scenario)
    assert h.finish("r").finish_reason == "error"
    assert h.finish("r").error == "checksum mismatch again"
    assert h.count("transfer_retries") == 1 and h.tokens("r") == [] and idle(h)


def _decoding(h: Harness, worker_id: str, request_id: str, tokens: list[int],
              **params: Any) -> Coroutine[Any, Any, None]:
    """Start a short request on `worker_id` and stream `tokens` of it."""
    async def go() -> None:
        h.start(request_id, SHORT, **params)
        await until(lambda: any(c.request_id == f"{request_id}@1"
                                for c in h.pool.to(worker_id, Generate)))
        h.step(worker_id, TokenRecord(request_id=f"{request_id}@1", token_ids=tokens))
        await until(lambda: h.tokens(request_id) == tokens)
    return go()


def test_a_dead_decode_workers_request_resumes_elsewhere_from_its_streamed_tokens() -> None:
    async def scenario(h: Harness) -> None:
        dead = h.pool.add("decode-0", Role.DECODE)
        await _decoding(h, "decode-0", "r", [5, 6], max_tokens=4)
        h.pool.add("decode-1", Role.DECODE)
        dead.state = "dead"
        h.dispatcher.migrate_off(dead)
        await until(lambda: h.pool.to("decode-1"))
        # A late record of the dead worker's attempt is dropped.
        h.step("decode-0", TokenRecord(request_id="r@1", token_ids=[99]))
        h.step("decode-1", TokenRecord(request_id="r@2", token_ids=[7, 8],
                                       finish_reason="length"))

    h = run(scenario)
    assert h.pool.to("decode-1") == [Generate(
        request_id="r@2", prompt_token_ids=SHORT, params=h.pool.to("decode-1")[0].params,
        remote_prefill=False, output_token_ids=[5, 6])]
    assert h.tokens("r") == [5, 6, 7, 8] and h.finish("r").finish_reason == "length"
    assert h.count("migrations") == 1
    assert not h.pool.to("decode-0", Abort)  # nothing is sent to a dead worker
    assert not h.pool.workers["decode-1"].in_flight


def test_without_migration_a_dead_workers_requests_end_in_error() -> None:
    async def scenario(h: Harness) -> None:
        dead = h.pool.add("decode-0", Role.DECODE)
        await _decoding(h, "decode-0", "r", [5])
        h.pool.add("decode-1", Role.DECODE)
        dead.state = "dead"
        h.dispatcher.migrate_off(dead)

    h = run(scenario, migrate=False)
    assert h.finish("r").finish_reason == "error"
    assert h.finish("r").error == "worker decode-0 went away"
    assert not h.pool.to("decode-1") and h.count("migrations") == 0


def test_a_joining_decode_worker_takes_the_requests_with_most_output_left() -> None:
    """Four requests on decode-0 that may move, and three that must stay: a seeded sample
    (a move would restart its random stream), one with fewer than 32 tokens left, and one
    still prefilling (no token streamed). decode-1 joins: 7 and 0 become 4 and 3, so three
    move, those with the most output left."""
    async def scenario(h: Harness) -> None:
        h.pool.add("decode-0", Role.DECODE)
        for i, max_tokens in enumerate((100, 200, 150, 120)):
            await _decoding(h, "decode-0", f"m{i}", [1], max_tokens=max_tokens)
        await _decoding(h, "decode-0", "seeded", [1], max_tokens=500, temperature=0.8, seed=3)
        await _decoding(h, "decode-0", "short", [1],
                        max_tokens=MIN_TOKENS_LEFT_TO_MOVE)  # 31 left
        h.start("prefilling", SHORT, max_tokens=500)
        await until(lambda: len(h.pool.to("decode-0", Generate)) == 7)
        joined = h.pool.add("decode-1", Role.DECODE)
        h.dispatcher.spread_onto(joined)
        await until(lambda: len(h.pool.to("decode-1", Generate)) == 3)
        assert len(h.pool.workers["decode-0"].in_flight) == 4
        assert len(h.pool.workers["decode-1"].in_flight) == 3
        for state in list(h.dispatcher.requests.values()):
            h.step(state.decode, TokenRecord(request_id=state.attempt_id, finish_reason="stop"))

    h = run(scenario)
    moved = sorted(c.request_id for c in h.pool.to("decode-1", Generate))
    assert moved == ["m1@2", "m2@2", "m3@2"]
    assert all(c.output_token_ids == [1] for c in h.pool.to("decode-1", Generate))
    assert h.count("spread_moves") == 3 and h.count("migrations") == 0
    assert idle(h)


def test_a_reservation_nobody_waits_for_is_released() -> None:
    async def scenario(h: Harness) -> None:
        h.pool.add("decode-0", Role.DECODE)
        h.reply("decode-0", Reserved(worker_id="decode-0", request_id="gone@3",
                                     dst_block_ids=[1], num_cached_tokens=0))
        await until(lambda: h.pool.sent)

    h = run(scenario)
    assert h.pool.sent == [("decode-0", Abort(request_id="gone@3"))]


def test_an_abort_reaches_both_workers_and_a_client_that_leaves_releases_its_request(
        ) -> None:
    async def scenario(h: Harness) -> None:
        await _prefilling_remotely(h, "r")
        assert h.dispatcher.abort("r") and not h.dispatcher.abort("unknown")
        await until(lambda: h.pool.to("prefill-0", Abort) and h.pool.to("decode-0", Abort))
        h.step("decode-0", TokenRecord(request_id="r@1", finish_reason="abort"))
        # A client that stops reading mid-stream: its request is aborted and released.
        h.start("left", SHORT)
        await until(lambda: h.pool.to("decode-0", Generate)[-1].request_id == "left@1")
        h.streams.pop("left").cancel()
        await until(lambda: Abort(request_id="left@1") in h.pool.to("decode-0", Abort))

    h = run(scenario)
    assert h.finish("r").finish_reason == "abort" and h.tokens("r") == []
    assert idle(h) and not h.dispatcher.requests


@pytest.mark.parametrize("state", ["draining", "dead"])
def test_a_prefill_worker_gone_before_its_prefill_sends_the_request_home(state: str) -> None:
    """Between the reservation and the prefill, the chosen prefill worker left: the
    reservation is released and the decode worker prefills the prompt itself."""
    async def scenario(h: Harness) -> None:
        h.pool.add("decode-0", Role.DECODE)
        prefill = h.pool.add("prefill-0", Role.PREFILL)
        h.start("r", LONG, max_tokens=1)
        await until(lambda: h.pool.to("decode-0"))
        prefill.state = state
        h.reply("decode-0", Reserved(worker_id="decode-0", request_id="r@1",
                                     dst_block_ids=[1], num_cached_tokens=0))
        await until(lambda: len(h.pool.to("decode-0", Generate)) == 2)
        h.step("decode-0", TokenRecord(request_id="r@2", token_ids=[3], finish_reason="stop"))

    h = run(scenario)
    assert not h.pool.to("prefill-0", Prefill)
    assert Abort(request_id="r@1") in h.pool.to("decode-0", Abort)
    assert h.pool.to("decode-0", Generate)[1].remote_prefill is False
    assert h.tokens("r") == [3] and h.count("migrations") == 0 and idle(h)
