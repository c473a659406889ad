"""The simulator against closed forms: M/D/1 prefill queueing, exact decode step counts, the
disaggregated path's exact timeline, prefix hits and KV preemption from the real scheduler."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.block_pool import hash_blocks
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from planner.simulator import ClusterShape, Simulation
from protocol.serving import TraceRequest
from router.placement import PrefixIndex
from tests.planner.synthetic import poisson_arrivals, random_prompts, synthetic_profile, trace

# The queueing tests' prompts: one block (the synthetic profile's block size).
PROMPT_LEN = 16


def one_worker(max_tokens: int, max_num_seqs: int = 64) -> ClusterShape:
    return ClusterShape("colocated", 0, 1, max_num_batched_tokens=max_tokens,
                        max_num_seqs=max_num_seqs)


def test_one_prefill_worker_is_an_md1_queue() -> None:
    """One-token answers on one worker whose budget fits one prompt: a FIFO queue with a
    deterministic service time S. Each request's wait must follow Lindley's recursion on
    the same arrivals exactly, and the mean wait the M/D/1 formula rho S / (2 (1 - rho))
    within four standard errors (batch means over 20 batches, since waits are correlated).
    10,000 requests keep the standard error near 6 % of the mean, inside the 10 % the
    power check below allows. (The step time is S whatever the prompt: one-block prompts
    keep the simulator's prefix hashing short.)"""
    service_s, rho, n = 0.1, 0.6, 10_000
    arrivals = poisson_arrivals(n, rho / service_s, seed=11)
    prompts = random_prompts(n, PROMPT_LEN, seed=12)
    profile = synthetic_profile(prefill=(service_s, 0.0, 0.0, 0.0))

    result = Simulation(one_worker(PROMPT_LEN), profile, profile).run(
        trace(arrivals, prompts, 1))

    waits = result.ttft - service_s
    lindley = np.zeros(n)
    for i in range(1, n):
        lindley[i] = max(0.0, lindley[i - 1] + service_s - (arrivals[i] - arrivals[i - 1]))
    np.testing.assert_allclose(waits, lindley, atol=1e-9)
    assert result.num_steps == n

    expected = rho * service_s / (2 * (1 - rho))
    batch_means = waits[n // 10:].reshape(20, -1).mean(axis=1)  # first 10 %: warm-up
    stderr = batch_means.std(ddof=1) / np.sqrt(len(batch_means))
    assert abs(batch_means.mean() - expected) < 4 * stderr
    assert stderr < 0.1 * expected  # the test has the power to see a 10 % error


def test_step_time_spread_makes_one_worker_an_mg1_queue() -> None:
    """As above, with each step drawn about S with coefficient of variation 1
    (`Profile.step_cv`): the worker still serves one request at a time in arrival order,
    its steps have mean S and spread cv, and the mean wait doubles to the
    Pollaczek-Khinchine value rho S (1 + cv^2) / (2 (1 - rho)). The same seed gives the
    same run (checked on the first 2,000 requests: the M/G/1 statistics need all 20,000)."""
    service_s, rho, n, cv = 0.1, 0.6, 20_000, 1.0
    arrivals = poisson_arrivals(n, rho / service_s, seed=11)
    profile = replace(synthetic_profile(prefill=(service_s, 0.0, 0.0, 0.0)), step_cv=cv)
    requests = trace(arrivals, random_prompts(n, PROMPT_LEN, seed=12), 1)

    result = Simulation(one_worker(PROMPT_LEN), profile, profile, seed=5).run(requests)

    once, again = (Simulation(one_worker(PROMPT_LEN), profile, profile, seed=5)
                   .run(requests[:2000]) for _ in range(2))
    np.testing.assert_array_equal(once.ttft, again.ttft)
    np.testing.assert_array_equal(once.ttft, result.ttft[:2000])  # later arrivals change nothing
    assert result.num_steps == n
    finish = arrivals + result.ttft
    starts = np.maximum(arrivals, np.concatenate(([0.0], finish[:-1])))  # FIFO, one server
    service = finish - starts
    assert (service > 0).all()
    assert service.sum() == pytest.approx(result.busy_s)
    assert service.mean() == pytest.approx(service_s, rel=4 * cv / np.sqrt(n))
    assert service.std() / service.mean() == pytest.approx(cv, rel=0.1)

    waits = starts - arrivals
    expected = rho * service_s * (1 + cv * cv) / (2 * (1 - rho))
    batch_means = waits[n // 10:].reshape(20, -1).mean(axis=1)
    stderr = batch_means.std(ddof=1) / np.sqrt(len(batch_means))
    assert abs(batch_means.mean() - expected) < 4 * stderr
    assert stderr < 0.1 * expected  # power to tell it from M/D/1's wait, half of this


def test_a_fixed_decode_batch_takes_exactly_one_step_per_token() -> None:
    """B prompts at 0, budget for all of them: one prefill step, then output - 1 decode
    steps whose time grows with the context read; every token time is known exactly."""
    batch, prompt_len, output_len = 8, 32, 20
    prefill, base, per_seq, per_kilotoken = 0.05, 0.01, 0.002, 0.004
    profile = synthetic_profile(prefill=(prefill, 0.0, 0.0, 0.0),
                                decode=(base, per_seq, per_kilotoken))
    requests = trace(np.zeros(batch), random_prompts(batch, prompt_len, seed=3), output_len)

    result = Simulation(one_worker(batch * prompt_len), profile, profile).run(requests)

    assert result.num_steps == output_len
    # Decode step k (1-based) attends to prompt + k tokens for each request.
    steps = [base + per_seq * batch + per_kilotoken * batch * (prompt_len + k) / 1e3
             for k in range(1, output_len)]
    assert result.first_token == pytest.approx([prefill] * batch)
    assert result.finish == pytest.approx([prefill + sum(steps)] * batch)
    assert result.tpot == pytest.approx([sum(steps) / (output_len - 1)] * batch)


def test_busy_neighbours_on_a_host_slow_each_step() -> None:
    """Two colocated workers on one host, each given one request at 0: both steps run side
    by side and take (1 + slowdown) times as long. On two hosts (one worker each), or once
    the neighbour is idle, steps take their own time."""
    slowdown, prefill, decode = 0.25, 0.1, 0.02
    profile = replace(synthetic_profile(prefill=(prefill, 0.0, 0.0, 0.0),
                                        decode=(decode, 0.0, 0.0)),
                      neighbour_slowdown=slowdown, workers_per_host=2)
    shape = ClusterShape("colocated", 0, 2)
    requests = trace(np.zeros(2), random_prompts(2, 16, seed=5), 3)

    shared = Simulation(shape, profile, profile).run(requests)
    alone = Simulation(shape, replace(profile, workers_per_host=1),
                       replace(profile, workers_per_host=1)).run(requests)

    assert shared.first_token == pytest.approx([prefill * (1 + slowdown)] * 2)
    assert shared.finish == pytest.approx([(prefill + 2 * decode) * (1 + slowdown)] * 2)
    assert alone.finish == pytest.approx([prefill + 2 * decode] * 2)

    # One request only: its neighbour never steps, so nothing slows it.
    single = Simulation(shape, profile, profile).run(requests[:1])
    assert single.finish == pytest.approx([prefill + 2 * decode])


def test_max_num_seqs_splits_the_batch_into_waves() -> None:
    """8 requests, 4 at a time: the second wave starts when the first finishes."""
    profile = synthetic_profile(prefill=(0.05, 0.0, 0.0, 0.0), decode=(0.01, 0.0, 0.0))
    requests = trace(np.zeros(8), random_prompts(8, 16, seed=4), 10)

    result = Simulation(one_worker(4096, max_num_seqs=4), profile, profile).run(requests)

    wave = 0.05 + 9 * 0.01
    assert result.num_steps == 20
    assert result.finish == pytest.approx([wave] * 4 + [2 * wave] * 4)


def test_the_disaggregated_path_is_prefill_then_transfer_then_decode() -> None:
    """A long prompt goes to P; its first token reaches the client when the exposed transfer
    (fixed + per block) has passed; D then decodes; a short prompt stays on D."""
    profile = synthetic_profile(prefill=(0.02, 1e-4, 0.0, 0.0), decode=(0.01, 0.0, 0.0),
                                transfer=(0.003, 1e-4))
    shape = ClusterShape("disaggregated", 1, 1, local_prefill_threshold=100)
    long_prompt, short_prompt = random_prompts(2, 320, seed=5)
    requests = [TraceRequest(0.0, 5, long_prompt), TraceRequest(10.0, 3, short_prompt[:50])]

    result = Simulation(shape, profile, profile).run(requests)

    prefill_s, transfer_s = 0.02 + 320e-4, 0.003 + 20 * 1e-4  # 320 tokens = 20 blocks
    assert result.first_token[0] == pytest.approx(prefill_s + transfer_s)
    assert result.finish[0] == pytest.approx(prefill_s + transfer_s + 4 * 0.01)
    assert result.first_token[1] == pytest.approx(10.0 + 0.02 + 50e-4)  # local prefill
    assert result.num_local_prefills == 1


def test_the_serving_paths_latency_delays_every_token_the_client_sees_alike() -> None:
    """`response_latency_s` (the decode profile's: tokens reach the client from D) adds to
    each request's first and last token and nothing else: the engine's steps, TPOT and
    the counts are those of the run without it."""
    profile = synthetic_profile(prefill=(0.02, 1e-4, 0.0, 0.0), decode=(0.01, 0.0, 0.0),
                                transfer=(0.003, 1e-4))
    shape = ClusterShape("disaggregated", 1, 1, local_prefill_threshold=100)
    prompts = random_prompts(12, (30, 300), seed=8)
    requests = trace(poisson_arrivals(12, 20.0, seed=8), prompts, 6)
    slow = replace(profile, response_latency_s=0.04)

    plain = Simulation(shape, profile, profile).run(requests)
    late = Simulation(shape, profile, slow).run(requests)
    prefill_only = Simulation(shape, slow, profile).run(requests)

    assert late.first_token == pytest.approx(plain.first_token + 0.04)
    assert late.finish == pytest.approx(plain.finish + 0.04)
    assert late.tpot == pytest.approx(plain.tpot)
    assert (late.num_steps, late.busy_s, late.num_local_prefills) == \
        (plain.num_steps, plain.busy_s, plain.num_local_prefills)
    assert prefill_only.first_token == pytest.approx(plain.first_token)


def test_a_repeated_prompt_hits_the_prefix_cache_on_the_same_worker() -> None:
    """The second copy of a prompt computes only its last partial block (real prefix cache,
    and the router's prefix affinity sends it back to the worker that has it)."""
    profile = synthetic_profile(prefill=(0.01, 1e-3, 0.0, 0.0))
    prompt = random_prompts(1, 100, seed=6)[0]  # 6 full blocks + 4 tokens
    shape = ClusterShape("colocated", 0, 4)
    requests = [TraceRequest(0.0, 1, prompt), TraceRequest(1.0, 1, prompt)]

    result = Simulation(shape, profile, profile).run(requests)

    assert result.ttft == pytest.approx([0.01 + 100e-3, 0.01 + 4e-3])


def test_a_full_kv_pool_preempts_and_recomputes() -> None:
    """Two requests that together outgrow an 8-block pool: the newest is preempted (the
    engine's policy) and both still finish."""
    profile = synthetic_profile(num_blocks=8)
    requests = trace(np.zeros(2), random_prompts(2, 48, seed=7), 40)

    result = Simulation(one_worker(4096), profile, profile).run(requests)

    assert result.num_preemptions >= 1
    assert np.isfinite(result.finish).all()


def test_router_and_engine_hash_prefixes_with_one_function() -> None:
    prompt = random_prompts(1, 70, seed=8)[0]
    request = Request("r", prompt, SamplingParams())
    from engine.block_pool import BlockPool

    engine_hashes = KVCacheManager(BlockPool(8), 16).block_hashes(request)
    assert PrefixIndex(16).hashes(prompt) == engine_hashes == hash_blocks(prompt, 16)
    assert len(engine_hashes) == 4


def test_bad_traces_are_refused_with_a_clear_error() -> None:
    profile = synthetic_profile()
    sim = Simulation(one_worker(2048), profile, profile)
    with pytest.raises(ValueError, match="no requests"):
        sim.run([])
    with pytest.raises(ValueError, match="exceed the profile's max_model_len 8192"):
        Simulation(one_worker(2048), profile, profile).run(
            [TraceRequest(0.0, 500, [5] * 8000)])
    small = synthetic_profile(num_blocks=8)  # the engine's limit: the whole pool
    with pytest.raises(ValueError, match="max_model_len 128"):
        Simulation(one_worker(2048), small, small).run([TraceRequest(0.0, 10, [5] * 120)])
    with pytest.raises(ValueError, match="same block_size"):
        Simulation(one_worker(2048), profile, synthetic_profile(block_size=32))


def test_a_reservation_that_never_finds_room_fails_after_the_router_timeout() -> None:
    """Two 300-token prompts, a 24-block (384-token) decode pool: the second cannot reserve
    until the first's 70 one-second decode steps end, past the router's 60 s timeout."""
    profile = synthetic_profile(decode=(1.0, 0.0, 0.0), num_blocks=24)
    first, second = random_prompts(2, 300, seed=9)
    shape = ClusterShape("disaggregated", 1, 1, local_prefill_threshold=0)

    result = Simulation(shape, profile, profile).run(
        [TraceRequest(0.0, 70, first), TraceRequest(0.001, 2, second)])

    assert result.num_failed == 1
    assert np.isfinite(result.ttft[0]) and np.isnan(result.ttft[1])
    assert result.duration == pytest.approx(result.finish[0])


def test_kv_transfers_from_one_prefill_worker_share_its_nic() -> None:
    """Two 320-token prompts (20 blocks each) prefilled in one step by P (0.02 + 640 x 1e-4
    = 0.084 s), then shipped to D: 0.003 s fixed + 20 blocks x 1 ms on the wire each. The
    first arrives at 0.084 + 0.023 = 0.107 s; the second's wire time starts when the first's
    ends (the same NIC at both ends): 0.107 + 0.020 = 0.127 s, not 0.107 as two independent
    timers would have it. One-token answers: the first token is the last."""
    profile = synthetic_profile(prefill=(0.02, 1e-4, 0.0, 0.0), decode=(0.01, 0.0, 0.0),
                                transfer=(0.003, 1e-3))
    shape = ClusterShape("disaggregated", 1, 1, local_prefill_threshold=100)
    requests = [TraceRequest(0.0, 1, p) for p in random_prompts(2, 320, seed=5)]

    result = Simulation(shape, profile, profile).run(requests)

    assert sorted(result.first_token) == pytest.approx([0.107, 0.127])


def test_a_transfer_to_a_decode_worker_of_fewer_ranks_has_fewer_links() -> None:
    """The prefill profile's transfer model ships over min(TP, KV heads) links at once
    (each rank its heads over its own NIC): at TP 4 with 8 KV heads, 4. To a TP-4 decode
    worker the same 4 links receive; to a TP-2 one, 2, so the wire part takes twice as
    long, and to TP 1 four times. The fixed part does not change; nor does a transfer to a
    worker of more ranks than the sender's (the sender's links stay the limit)."""
    transfer = (0.003, 1e-3)
    profile = synthetic_profile(prefill=(0.02, 1e-4, 0.0, 0.0), decode=(0.01, 0.0, 0.0),
                                transfer=transfer)
    at = {tp: replace(profile, hardware={**profile.hardware, "tp": tp, "kv_heads": 8})
          for tp in (1, 2, 4, 8)}
    shape = ClusterShape("disaggregated", 1, 1, local_prefill_threshold=100)
    requests = [TraceRequest(0.0, 1, random_prompts(1, 320, seed=5)[0])]  # 20 blocks

    def first_token(prefill: int, decode: int) -> float:
        return Simulation(shape, at[prefill], at[decode]).run(requests).first_token[0]

    prefill_s, wire_s = 0.02 + 320e-4, 20 * 1e-3
    for decode, links in ((4, 4), (8, 4), (2, 2), (1, 1)):
        assert first_token(4, decode) == pytest.approx(prefill_s + 0.003 + wire_s * 4 / links)
    assert first_token(1, 4) == pytest.approx(prefill_s + 0.003 + wire_s)
    assert at[4].transfer_links_to(at[1]) == 4 and profile.transfer_links_to(profile) == 1
