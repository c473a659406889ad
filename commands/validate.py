"""`plan --validate`: serve configurations for real, replay the trace, compare with the plan.

Each configuration is started with `pdcluster serve` as a child process
(`commands.launch`) on `--address`, or on one local Ray instance this process starts for
all of them (`local_ray`: a server's own would cost a Ray start per configuration), warmed
up with a few requests, and sent the plan's trace (same prompts, same arrivals, same output
lengths) by the `pdcluster bench` load generator.
The bench scores the run with `protocol.slo`, the scorer the planner predicts with, so the
measured figures are the predicted ones' keys and definitions; they are written beside the
predicted ones with the error of each:

- latencies and goodput: relative error, (predicted - measured) / measured;
- attainment: the difference in points, predicted - measured.

The prediction compared is, by default (`calibration="serving"`), made again on the served
configuration just before its replay: the profile is calibrated through the server
(`commands.serving_calibration.ServingCalibrator`: a probe stream, then a pilot trace drawn
from the trace's own lengths, mix and arrival gaps with fresh token ids, `pilot_trace`;
the pilot's first tokens against the simulated ones give the serving path's latency,
`response_latency`), and the configuration is simulated again with that profile on the
trace at its rate (`repredict`). The trace's own requests are never sent before its
replay. With `calibration="bare"` the plan's prediction (its profile as `plan` calibrated
it on a bare engine, or as measured) is compared.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.run import RunSettings, Target, bench_run
from commands.launch import pdcluster_serve
from commands.serving_calibration import (
    ServingCalibrator,
    pilot_trace,
    probe_prompts,
    response_latency,
)
from engine import defaults
from planner.calibrate import PROBE_BATCHES, scaled_by_record
from planner.measure import VOCAB
from planner.plan import PlanRequest, label, predict, shape_of
from planner.profile import Profile
from protocol.serving import Slo, TraceRequest
from protocol.slo import ATTAINMENT, GOODPUT

# The figures whose error the validation reports.
FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", ATTAINMENT, GOODPUT)
_WARMUP_OUTPUT = 2
_WARMUP_SEED = 987_654
CALIBRATIONS = ("serving", "bare")
PILOT_REQUESTS = 20
PILOT_SEED = 424_242  # the pilot's own: its token ids and draws are not the trace's


def serve_flags(config: dict[str, Any], profile: Profile,
                max_num_seqs: int = defaults.MAX_NUM_SEQS,
                address: str | None = None, local: bool = False) -> list[str]:
    """`pdcluster serve` flags that build a plan configuration as the profile measured it
    (`local`: `address` is a one-node Ray instance on this machine, `local_ray`'s)."""
    flags = ["--mode", config["mode"], "--decode", str(config["decode"]),
             "--torch-threads", str(config["threads_per_worker"]),
             "--max-num-batched-tokens", str(config["max_num_batched_tokens"]),
             "--max-num-seqs", str(max_num_seqs),
             "--local-prefill-threshold", str(config["local_prefill_threshold"]),
             "--kv-cache-gb", f"{profile.kv_cache_gb:g}", "--dtype", profile.dtype,
             "--transport", profile.transport]
    if config["mode"] == "disaggregated":
        flags += ["--prefill", str(config["prefill"])]
    if address:
        flags += ["--address", address]
    if local:  # the workers on loopback, as on a server's own local Ray (no CURVE)
        flags += ["--worker-host", "127.0.0.1"]
    return flags


def measured_figures(report: dict[str, Any]) -> dict[str, float | None]:
    """A bench report's figures (`protocol.slo.score`'s keys), its failed requests and its
    mean step."""
    summary = report["summary"]
    return {**summary["figures"], "failed": summary["failed"],
            "mean_step_ms": mean_step_ms(report)}


def mean_step_ms(report: dict[str, Any]) -> float | None:
    """Milliseconds per engine step over every worker in the run (None without counters)."""
    workers = ((report.get("utilization") or {}).get("workers") or {}).values()
    timed = [w for w in workers if w.get("mean_step_ms") is not None]
    steps = sum(w["steps"] for w in timed)
    return sum(w["mean_step_ms"] * w["steps"] for w in timed) / steps if steps else None


def errors(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, float | None]:
    """Relative error of each figure (attainment: difference in points as a fraction)."""
    out: dict[str, float | None] = {}
    for key in FIGURES:
        p, m = predicted.get(key), measured.get(key)
        if p is None or m is None:
            out[key] = None
        elif key == ATTAINMENT:
            out[key] = p - m
        else:
            out[key] = (p - m) / m if m else None
    return out


def run_config(config: dict[str, Any], profile: Profile,
               runs: Callable[[Target], Iterable[tuple[str, list[TraceRequest], Slo]]],
               out: Path, max_num_seqs: int = defaults.MAX_NUM_SEQS,
               address: str | None = None, local: bool = False) -> dict[str, dict[str, Any]]:
    """Serve one configuration and replay each trace on it, one after another.

    Args:
        config: a plan file's configuration entry (`plan.shape_entry`'s keys suffice).
        profile: the profile it was planned with (model, dtype, KV budget, transport).
        runs: given the warm server, the runs: (run name, trace, the SLO to score it
            with), taken one at a time just before each replay, so a generator can make
            each run when it is due (the planner-accuracy experiment calibrates on the
            server and predicts each point right before it is replayed).
        out: where each run's report and the server log go.
        max_num_seqs: `serve --max-num-seqs`.
        address: an existing Ray cluster, or None for the server's own local one.
        local: `address` is `local_ray`'s instance (the workers stay on loopback).

    Returns:
        Per run name, the measured figures.
    """
    name = label(config).replace(" ", "-")
    settings = RunSettings(config={"model": profile.model, "config": config})
    results = {}
    with pdcluster_serve(profile.model,
                         serve_flags(config, profile, max_num_seqs, address, local),
                         out / name / "serve.log") as endpoints:
        target = Target("grpc", endpoints.grpc, endpoints.grpc)
        warm = warmup_requests(config, profile)
        bench_run(target, warm, ["warm-up"] * len(warm), label="warm-up", out=None,
                  settings=settings, max_concurrency=1)
        for run_name, requests, slo in runs(target):
            report = bench_run(target, requests, [run_name] * len(requests),
                               label=f"{name}-{run_name}", out=out / name / run_name,
                               settings=settings, slo=slo)
            results[run_name] = measured_figures(report)
    return results


def warmup_requests(config: dict[str, Any], profile: Profile) -> list[TraceRequest]:
    """A few short requests to warm a fresh server: two prompts below the local-prefill
    threshold and two above it, so a decode worker's own prefill and the prefill workers
    have both run. Their own random prompts: nothing they leave in the prefix cache is hit
    by the runs."""
    rng = np.random.default_rng(_WARMUP_SEED)
    long = min(config["local_prefill_threshold"] + 16, profile.max_model_len - _WARMUP_OUTPUT)
    return [TraceRequest(0.0, _WARMUP_OUTPUT, rng.integers(*VOCAB, n).tolist())
            for n in (16, 16, long, long)]


def role(doc: dict[str, Any], config: dict[str, Any]) -> str:
    """What a configuration is to the plan: `recommended`, `rejected` (predicted to miss
    the SLO) or `other` (predicted to meet it, not the pick)."""
    if doc["recommended"] is not None and config == doc["recommended"]:
        return "recommended"
    return "other" if config["meets_slo"] else "rejected"


def served_configs(doc: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """The configurations `--validate` serves: the recommended one, the closest one the plan
    rejects (when one does), then the closest others up to `count` in all (fewest workers
    moved, same mode first). Without a recommendation, the best attainments (all rejected).
    """
    configs = doc["configs"]
    best = doc["recommended"]
    if best is None:
        return sorted(configs, key=lambda c: -c["predicted"][ATTAINMENT])[:max(count, 1)]

    def distance(c: dict[str, Any]) -> tuple[int, int]:
        return (abs(c["prefill"] - best["prefill"]) + abs(c["decode"] - best["decode"])
                + (0 if c["mode"] == best["mode"] else 1), c["prefill"] + c["decode"])

    by_distance = sorted((c for c in configs if c != best), key=distance)
    rejected = [c for c in by_distance if role(doc, c) == "rejected"][:1]
    rest = [c for c in by_distance if c not in rejected]
    return [best, *rejected, *rest][:max(count, 1 + len(rejected))]


def validate(doc: dict[str, Any], request: PlanRequest, count: int, address: str | None,
             out: Path, calibration: str = "serving",
             profiles: tuple[Profile, Profile] | None = None,
             pilot_requests: int = PILOT_REQUESTS,
             probe_batches: Sequence[int] = PROBE_BATCHES) -> dict[str, Any]:
    """Serve `served_configs(doc, count)` and replay the trace on each; adds
    `validation_role`, `measured` and `error` to each served entry, and with serving
    calibration `served_calibration`, `repredicted`, `repredicted_meets_slo` and
    `slo_verdict_changed` (`served_prediction`).

    Args:
        doc: the plan.
        request: what was planned (its profiles as the plan used them).
        count: configurations to serve (`served_configs`).
        address: an existing Ray cluster, or None for a local one.
        out: where the reports and server logs go.
        calibration: `serving` (the prediction compared is made again on each served
            configuration, calibrated through it) or `bare` (the plan's prediction).
        profiles: the (prefill, decode) profiles as measured, which serving calibration
            scales; None: the request's.
        pilot_requests: requests in the pilot trace.
        probe_batches: the decode batch sizes the serving calibration probes.

    Raises:
        ValueError: an unknown calibration, or `pilot_requests` < 1 with serving.
    """
    if calibration not in CALIBRATIONS:
        raise ValueError(f"calibration must be one of {', '.join(CALIBRATIONS)}, "
                         f"got {calibration!r}")
    if calibration == "serving" and pilot_requests < 1:
        raise ValueError(f"the pilot needs at least one request, got {pilot_requests}")
    profiles = profiles or (request.prefill_profile, request.decode_profile)
    configs = served_configs(doc, count)
    with local_ray(address, max(c.get("prefill", 0) + c["decode"] for c in configs)
                   if configs else 0) as ray_address:
        for config in configs:
            config["validation_role"] = role(doc, config)
            runs = _served_runs(config, request, profiles, pilot_requests, probe_batches) \
                if calibration == "serving" else lambda _target: [("trace", request.requests,
                                                                  request.slo)]
            measured = run_config(config, request.decode_profile, runs, out,
                                  request.max_num_seqs, ray_address,
                                  local=ray_address != address)["trace"]
            measured["meets_slo"] = measured["failed"] == 0 and request.slo.meets(measured)
            config["measured"] = measured
            config["error"] = errors(config.get("repredicted", config["predicted"]), measured)
    return doc


@contextlib.contextmanager
def local_ray(address: str | None, max_workers: int) -> Iterator[str | None]:
    """`address`, or a local Ray instance started here for every server the block runs
    (sized as `pdcluster serve` sizes its own) and stopped after it.

    Yields:
        The Ray address the servers join; `address` itself when given, and None when
        nothing is served (`max_workers` 0).
    """
    if address or not max_workers:
        yield address
        return
    import ray  # only here: planning without validation never needs Ray

    ray.init(num_cpus=max(os.cpu_count() or 1, 4 * max_workers), include_dashboard=False,
             log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _served_runs(config: dict[str, Any], request: PlanRequest,
                 profiles: tuple[Profile, Profile], pilot_requests: int,
                 probe_batches: Sequence[int]
                 ) -> Callable[[Target], Iterator[tuple[str, list[TraceRequest], Slo]]]:
    """`run_config`'s runs: on the warm server, calibrate and predict again (the entry
    gets `served_prediction`'s fields), then the trace."""
    def runs(target: Target) -> Iterator[tuple[str, list[TraceRequest], Slo]]:
        config.update(served_prediction(config, request, profiles, target, pilot_requests,
                                        probe_batches))
        yield "trace", request.requests, request.slo
    return runs


def served_prediction(config: dict[str, Any], request: PlanRequest,
                      profiles: tuple[Profile, Profile], target: Target,
                      pilot_requests: int = PILOT_REQUESTS,
                      probe_batches: Sequence[int] = PROBE_BATCHES) -> dict[str, Any]:
    """Calibrate `profiles` through the served configuration (a probe, then a pilot of
    `pilot_trace(request.requests, pilot_requests, PILOT_SEED)`; the serving path's
    latency from the pilot's first tokens, `response_latency`), and predict the
    configuration again with them (`repredict`).

    Returns:
        `repredict`'s fields; `{"served_calibration": {"applied": false, "reason"}}` when
        the calibration failed (no status from the server, a profile without a batch
        table), and the plan's prediction is compared.
    """
    pilot = pilot_trace(request.requests, pilot_requests, PILOT_SEED)
    prompts = probe_prompts(request.requests, profiles[1].max_model_len - 2)
    shape = shape_of(config, request.max_num_seqs)
    try:
        calibrator = ServingCalibrator(profiles[1], shape, target,
                                       lambda _scaled, _workload: pilot, prompts,
                                       probe_batches)
        _, record = calibrator("trace")
        latency = response_latency(*(scaled_by_record(p, record) for p in profiles), shape,
                                   *calibrator.pilots["trace"])
        return repredict(config, request, profiles,
                         {"applied": True, **record, "response_latency_ms": 1e3 * latency,
                          "probe_prompts": list(prompts),
                          "pilot_requests": pilot_requests, "pilot_seed": PILOT_SEED})
    except ValueError as e:
        return {"served_calibration": {"applied": False, "reason": str(e)}}


def repredict(config: dict[str, Any], request: PlanRequest,
              profiles: tuple[Profile, Profile], record: dict[str, Any]) -> dict[str, Any]:
    """The configuration simulated again on the request's trace at its rate, both
    profiles scaled by a served calibration's record (`scaled_by_record`: its factors,
    step spread and response latency).

    Returns:
        `served_calibration` (the record), `repredicted` (the figures, as `predicted`),
        `repredicted_meets_slo`, and `slo_verdict_changed` (against the plan's
        `meets_slo`).
    """
    prefill, decode = (scaled_by_record(p, record) for p in profiles)
    again = PlanRequest(prefill, decode, request.requests, request.slo,
                        max_num_seqs=request.max_num_seqs,
                        cost_per_hour=request.cost_per_hour,
                        simulated_requests=request.simulated_requests)
    predicted = predict(again, shape_of(config, request.max_num_seqs))
    meets = request.slo.meets(predicted)
    return {"served_calibration": record, "repredicted": predicted,
            "repredicted_meets_slo": meets, "slo_verdict_changed": meets != config["meets_slo"]}
