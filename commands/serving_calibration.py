"""Calibrate a profile through a running server: probe requests sent through the router,
and a pilot trace, timed by the workers' own step totals (`Status`).

`planner.calibrate` scales a profile to steps (`scale_to_steps`); this module makes the
steps, on a served configuration, so the scaled profile includes what serving adds to a
step (the workers' other threads, the router, Ray, the load generator). `plan --validate`
(`commands.validate`) and the planner experiments use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from bench.loadgen import RequestRecord
from bench.run import RunSettings, Target, bench_run, status_snapshot
from bench.serving_metrics import latencies
from planner.calibrate import (
    PROBE_BATCHES,
    PROBE_PREFILL,
    StepWindow,
    replay_window,
    scale_to_steps,
)
from planner.measure import VOCAB
from planner.profile import Profile
from planner.simulator import ClusterShape, Simulation
from protocol.serving import DEFAULT_VOCAB_RANGE, TraceRequest

# The probe: per decode batch, short prompts (prefilled where they decode) with this many
# output tokens; then prefills of each probed length, this many, one at a time.
_PROMPT, _OUTPUT = 16, 17
_PREFILL_REPEATS = 4

Pilot = Callable[[Profile, str], list[TraceRequest]]


class ServingCalibrator:
    """Scales a profile to the steps the serving workers run now.

    A bare engine beside the server (`planner.calibrate.Calibrator`) misses what serving
    adds to a step: measured here, the serving workers' mean step ran 1.18-1.3x the
    bare-calibrated prediction on a decode-heavy mix (their other threads, the router,
    the load generator and Ray share the cores; workers run at Ray's lower priority). So
    each call sends a probe stream through the router (fresh random prompts, no prefix
    hits): for each batch size in `PROBE_BATCHES`, that many requests per decoding worker
    at once, then prompts of each `prefill_prompts` length one at a time; and it reads the
    workers' own step totals (`EngineLoop.step_totals`, in `Status`) before and after each
    group: the mean measured step of every batch size and the prompt steps' measured and
    modelled time (a prefill worker's with the profile's role factor) feed
    `planner.calibrate.scale_profile`. Steps taken while host-mates were stepping too
    (every decoding worker is busy in a decode group) are divided by the profile's
    neighbour slowdown for them, which the simulator applies again where it happens.

    The probe is short (a few dozen steps per batch size) and its steps are not the
    workload's: measured here, its batch-1 factor moved 0.39-0.56 from call to call while
    a workload's own steps stayed at 0.40-0.46. So a workload's calibration also pools, by
    step count, the steps the workers ran in the last replay of that workload
    (`remember`), and before its first calibration a pilot: a short trace like it
    (`pilot`, not scored), replayed. Both run before what is predicted from them, so the
    prediction is still a forecast.

    Args:
        profile: the profile as measured; each call scales this one.
        shape: the configuration being served.
        target: the server (its `status_address` must be set).
        pilot: given the probe-scaled profile and a workload, the pilot trace; None: no
            pilot.
        batches: the decode batch sizes probed, per decoding worker (each its own table
            entry, `planner.calibrate.scale_profile`).
        prefill_prompts: the prompt lengths the probe prefills (`_PREFILL_REPEATS` each,
            one at a time). Prompt steps share one factor, pooled by time, so a workload of
            long prompts wants them probed: a 1000-token prefill's attention share is
            larger, and on this machine it ran 14-19 % slower than a factor from 128-token
            prompts predicted.

    Attributes:
        pilots: per workload, its pilot's requests and each one's measured TTFT in
            seconds (NaN where it failed), for `response_latency`.

    Raises:
        ValueError: the target has no status address.
    """

    def __init__(self, profile: Profile, shape: ClusterShape, target: Target,
                 pilot: Pilot | None = None,
                 prefill_prompts: Sequence[int] = (PROBE_PREFILL,),
                 batches: Sequence[int] = PROBE_BATCHES) -> None:
        if target.status_address is None:
            raise ValueError("serving calibration reads the workers' step totals: the "
                             "target needs a status address")
        self.profile, self.target, self.pilot = profile, target, pilot
        self.prefill_prompts = tuple(prefill_prompts)
        if not batches or min(batches) < 1:
            raise ValueError(f"probe batch sizes must be >= 1, got {list(batches)}")
        self.batches = tuple(batches)
        self.decoding = shape.num_decode  # decode workers, or colocated ones
        self._rng = np.random.default_rng(23)
        self._settings = RunSettings(config={"model": profile.model, "run": "calibration"})
        self._replays: dict[str, tuple[str, StepWindow]] = {}
        self.pilots: dict[str, tuple[list[TraceRequest], np.ndarray]] = {}

    def __call__(self, workload: str | None = None) -> tuple[Profile, dict[str, Any]]:
        """The profile scaled to the probe stream's steps (pooled with the workload's
        last replay or pilot, if it has one), and the calibration record (`pooled`: what
        it was scaled to).

        Raises:
            ValueError: the server gave no status, or no decode or prompt step ran.
        """
        windows = self.probe()
        if workload is not None and workload not in self._replays and self.pilot:
            requests = self.pilot(scale_to_steps(self.profile, windows)[0], workload)
            before = status_snapshot(self.target.status_address)
            report = bench_run(self.target, requests, ["pilot"] * len(requests),
                               label="pilot", out=None, settings=self._settings)
            self.remember(workload, before, status_snapshot(self.target.status_address),
                          "pilot")
            self.pilots[workload] = (requests, first_token_seconds(report))
        return self.scale(windows, workload)

    def scale(self, probe: list[StepWindow], workload: str | None
              ) -> tuple[Profile, dict[str, Any]]:
        """The profile scaled to the probe's windows and the workload's last replay."""
        kind, replay = self._replays.get(workload or "", ("", None))
        scaled, record = scale_to_steps(self.profile, [*probe, replay] if replay else probe)
        record["pooled"] = ["probe", kind] if replay else ["probe"]
        return scaled, record

    def remember(self, workload: str, before: dict[str, Any] | None,
                 after: dict[str, Any] | None, kind: str = "replay") -> None:
        """The workers' steps between two `Status` snapshots, taken over a replay of
        `workload`, feed its next calibration in place of any earlier ones (a missing
        snapshot: nothing is kept, and the next calibration is the probe's alone)."""
        if before is None or after is None:
            self._replays.pop(workload, None)
            return
        self._replays[workload] = (kind, replay_window(self.profile, before, after))

    def probe(self) -> list[StepWindow]:
        """The probe stream's windows: (`Status` before, after, its neighbour slowdown)."""
        busy_mates = min(self.decoding, self.profile.workers_per_host) - 1
        groups = [(self._requests(batch * self.decoding, _PROMPT, _OUTPUT), None, busy_mates)
                  for batch in self.batches]
        groups += [(self._requests(_PREFILL_REPEATS, prompt, 2), 1, 0)
                   for prompt in self.prefill_prompts]
        windows = []
        for requests, concurrency, mates in groups:
            before = status_snapshot(self.target.status_address)
            bench_run(self.target, requests, ["calibration"] * len(requests),
                      label="calibration", out=None, settings=self._settings,
                      max_concurrency=concurrency)
            after = status_snapshot(self.target.status_address)
            windows.append((before, after, 1 + mates * self.profile.neighbour_slowdown))
        return windows

    def _requests(self, count: int, prompt: int, output: int) -> list[TraceRequest]:
        return [TraceRequest(0.0, output, self._rng.integers(*DEFAULT_VOCAB_RANGE,
                                                             prompt).tolist())
                for _ in range(count)]


def pilot_trace(trace: Sequence[TraceRequest], num: int, seed: int) -> list[TraceRequest]:
    """`num` requests like the trace's, none of them the trace's: each one's (prompt
    length, output length) pair and each gap between arrivals drawn, with replacement, from
    the trace's own (so its mix, lengths and rate), with fresh random token ids.

    Raises:
        ValueError: `num` < 1 or an empty trace.
    """
    if num < 1 or not trace:
        raise ValueError(f"a pilot needs requests and a trace to draw them from (num={num}, "
                         f"trace of {len(trace)})")
    rng = np.random.default_rng(seed)
    gaps = np.diff([r.timestamp for r in trace])
    arrivals = np.cumsum([0.0, *(rng.choice(gaps, num - 1) if len(gaps) else [0.0] * (num - 1))])
    picks = rng.integers(0, len(trace), num)
    return [TraceRequest(float(t), trace[i].output_len,
                         rng.integers(*VOCAB, len(trace[i].prompt_token_ids)).tolist())
            for t, i in zip(arrivals, picks, strict=True)]


def probe_prompts(trace: Sequence[TraceRequest], longest: int) -> tuple[int, ...]:
    """The prompt lengths a probe prefills for this trace: `PROBE_PREFILL` and the trace's
    90th-percentile prompt (at most `longest`), so the prompt factor sees prompts as long
    as the trace's long ones."""
    p90 = min(int(np.percentile([len(r.prompt_token_ids) for r in trace], 90)), longest)
    return tuple(sorted({PROBE_PREFILL, p90}))


def first_token_seconds(report: dict[str, Any]) -> np.ndarray:
    """Each request's TTFT in a bench report, in request order, as the bench defines it
    and scores it (`bench.serving_metrics.latencies`); NaN for a request that did not
    succeed."""
    records = sorted((RequestRecord(**r) for r in report["requests"]), key=lambda r: r.index)
    return latencies(records).ttft


def response_latency(prefill: Profile, decode: Profile, shape: ClusterShape,
                     requests: Sequence[TraceRequest], measured: np.ndarray,
                     runs: int = 8) -> float:
    """Seconds the serving path adds to a first token beyond the engine's steps
    (`Profile.response_latency_s`): the median over `requests` (a pilot, replayed on an
    idle server) of the measured TTFT less the simulated one, the configuration simulated
    with these profiles (calibrated, no latency of their own) and each request's TTFT
    averaged over `runs` seeds (one without a step spread); 0 where the simulation's
    TTFTs are the longer.

    Measured on this 2-core machine, the TTFT of the requests of a served trace ran a
    median 28-49 ms over their simulated TTFT (one or two colocated workers, fp32
    SmolLM2): the steps the simulator replays were calibrated on those workers, the path
    around them was not.

    Raises:
        ValueError: the counts differ, or no request has a measured TTFT.
    """
    if len(measured) != len(requests):
        raise ValueError(f"{len(measured)} measured TTFTs for {len(requests)} requests")
    ok = np.isfinite(measured)
    if not ok.any():
        raise ValueError("no pilot request has a measured first token")
    prefill, decode = (replace(p, response_latency_s=0.0) for p in (prefill, decode))
    seeds = range(runs if max(prefill.step_cv, decode.step_cv) > 0 else 1)  # else all alike
    simulated = np.nanmean([Simulation(shape, prefill, decode, seed).run(requests).ttft
                            for seed in seeds], axis=0)
    ok &= np.isfinite(simulated)
    return max(float(np.median(measured[ok] - simulated[ok])), 0.0) if ok.any() else 0.0
