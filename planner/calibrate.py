"""Scale a profile to the machine's speed now: the step models times factors measured on
probe steps (a bare engine's, `Calibrator`) or on the steps serving workers ran
(`scale_to_steps`, from two `Status` snapshots).

A shared machine's speed drifts (measured here: a batch-8 decode step 40 % slower than 30
minutes before, with nothing else running), so a prediction made from a profile measured
earlier is off by the drift; scaling the profile to steps timed just before removes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from engine import CacheConfig, LLMEngine, SchedulerConfig
from planner.measure import StepSampler, decode_samples, prefill_samples
from planner.profile import LinearModel, Profile, decode_features, work_features
from protocol.status import step_deltas, utilization_between

# Probe steps: decode-only steps of every batch size up to 16 at this context per sequence
# (a step is not smooth in the batch size: `scale_profile`), and a
# prefill of this many new tokens.
PROBE_BATCHES, PROBE_CONTEXT, PROBE_PREFILL = tuple(range(1, 17)), 128, 128
_PROBE_DECODE_STEPS, _PROBE_PREFILL_REPEATS = 8, 5
_MIN_STEPS = 4  # a batch size measured fewer times than this is left out
# (`Status` before, `Status` after, the neighbour slowdown its steps ran under)
StepWindow = tuple[dict[str, Any] | None, dict[str, Any] | None, float]


class Calibrator:
    """Scales a profile to the machine's speed now, as often as asked, on one engine.

    Each call times the probe steps (`batches`, `PROBE_PREFILL`) on an engine built as
    the profile's was and scales the profile's step models to them (`scale_to_probes`).
    The engine is built once and stays loaded between calls.

    Args:
        profile: the profile as measured; each call scales this one, not the last result.
        batches: the decode batch sizes probed (each gets its own table entry; the
            profile's other sizes are interpolated between them).
    """

    def __init__(self, profile: Profile, batches: Sequence[int] = PROBE_BATCHES) -> None:
        if not batches or min(batches) < 1:
            raise ValueError(f"calibration: probe batch sizes must be at least 1, got "
                             f"{list(batches)}")
        self.profile = profile
        self.batches = tuple(batches)
        engine = LLMEngine(profile.model, profile.dtype,
                           cache=CacheConfig(block_size=profile.block_size,
                                             kv_cache_memory_gb=profile.kv_cache_gb),
                           scheduler=SchedulerConfig(max_num_batched_tokens=8192),
                           num_threads=profile.torch_threads)
        self._sampler = StepSampler(engine, np.random.default_rng(17))

    def probe(self) -> dict[str, list[dict[str, Any]]]:
        """Timed probe steps, as `planner.measure` records samples: `{"decode": [...],
        "prefill": [...]}`."""
        decode = [(batch, PROBE_CONTEXT) for batch in self.batches]
        return {"decode": decode_samples(self._sampler, decode, _PROBE_DECODE_STEPS,
                                         _no_progress),
                "prefill": prefill_samples(self._sampler, [(PROBE_PREFILL, 0, 1)],
                                           _PROBE_PREFILL_REPEATS, _no_progress)}

    def __call__(self, workload: str | None = None) -> tuple[Profile, dict[str, Any]]:
        """The profile scaled to probes timed now, and the calibration record (the
        workload is not used: the probes are the same for every one)."""
        return scale_to_probes(self.profile, self.probe())


def replay_window(profile: Profile, before: dict[str, Any] | None,
                  after: dict[str, Any] | None) -> StepWindow:
    """The window of a replay for `scale_to_steps`: its steps' neighbour slowdown is taken
    as the profile's times the host-mates' mean busy fraction over it (all workers of the
    accuracy configurations share one host)."""
    busy = [w["busy"] for w in utilization_between(before, after).values()] \
        if before is not None and after is not None else []
    mates = min(len(busy), profile.workers_per_host) - 1
    return before, after, 1 + profile.neighbour_slowdown * mates * (
        sum(busy) / len(busy) if busy else 0)


def scale_to_steps(profile: Profile, windows: Sequence[StepWindow]
                   ) -> tuple[Profile, dict[str, Any]]:
    """The profile scaled to the steps serving workers ran (`scale_profile`).

    Args:
        windows: (`Status` before, `Status` after, the neighbour slowdown its steps ran
            under): each worker's step totals (`EngineLoop.step_totals`) grew between the
            two snapshots by the steps it ran in the window. Decode steps give each batch
            size's mean step (sizes with fewer than `_MIN_STEPS` steps are left out,
            sizes the profile's table lacks are added to it); prompt steps give measured
            over modelled time, a prefill worker's modelled with the profile's role
            factor. Measured seconds are divided by the window's slowdown. The decode
            steps' spread about their mean (per worker, window and batch size; pooled)
            becomes the profile's `step_cv`.

    Returns:
        As `scale_profile`, the record with the decode `steps` counted per batch size
        and the measured `step_cv` (absent, and the profile's kept, with no batch size
        stepped twice).

    Raises:
        ValueError: a snapshot is missing, or no decode or prompt step was measured.
    """
    decode: dict[int, list[float]] = {}
    prefill = [0.0, 0.0, 0.0]  # steps, measured seconds, modelled seconds
    spread = [0.0, 0.0]  # decode steps' squared deviations over their mean's square, dof
    for before, after, slowdown in windows:
        if before is None or after is None:
            raise ValueError("serving calibration: no status from the server")
        for role, totals in step_deltas(before, after):
            for key, values in totals.items():
                if key.startswith("decode_"):
                    steps, seconds, squares, tokens = values
                    if steps >= 2:
                        mean = seconds / steps
                        spread[0] += max(squares - steps * mean * mean, 0.0) / (mean * mean)
                        spread[1] += steps - 1
                    acc = decode.setdefault(int(key.removeprefix("decode_")), [0.0, 0.0, 0.0])
                    for i, value in enumerate((steps, seconds / slowdown, tokens)):
                        acc[i] += value
                elif key == "prompt":
                    steps, seconds, _, tokens, pairs, seqs = values
                    mean = profile.prefill.predict(work_features(tokens / steps, pairs / steps,
                                                                 seqs / steps))
                    role_factor = profile.prefill_role_factor if role == "prefill" else 1.0
                    for i, value in enumerate((steps, seconds / slowdown,
                                               steps * mean * role_factor)):
                        prefill[i] += value
    if not prefill[0]:
        raise ValueError("serving calibration: no prompt step was measured")
    measured = {b: (seconds / steps, tokens / steps)
                for b, (steps, seconds, tokens) in decode.items()
                if steps >= _MIN_STEPS}
    scaled, record = scale_profile(profile, measured, (prefill[1] / prefill[0],
                                                       prefill[2] / prefill[0]))
    record["steps"] = {**{f"decode_b{b}": int(v[0]) for b, v in sorted(decode.items())},
                       "prompt": int(prefill[0])}
    if spread[1]:
        record["step_cv"] = float(np.sqrt(spread[0] / spread[1]))
        scaled = replace(scaled, step_cv=record["step_cv"])
    return scaled, record


def _no_progress() -> None:
    pass


def scale_to_probes(profile: Profile, probes: dict[str, list[dict[str, Any]]]
                    ) -> tuple[Profile, dict[str, Any]]:
    """The profile scaled to reproduce `Calibrator.probe`'s timed steps (`scale_profile`:
    each probed batch's median step and its context, the median prefill probe)."""
    by_batch: dict[int, list[dict[str, Any]]] = {}
    for sample in probes["decode"]:
        by_batch.setdefault(len(sample["items"]), []).append(sample)
    decode = {batch: (float(np.median([s["y"] for s in samples])),
                      float(np.median([sum(a + n for a, n, _ in s["items"]) for s in samples])))
              for batch, samples in by_batch.items()}
    prefill = (float(np.median([s["y"] for s in probes["prefill"]])),
               float(np.median([profile.step_time(s["items"]) for s in probes["prefill"]])))
    return scale_profile(profile, decode, prefill)


def scale_profile(profile: Profile, decode: dict[int, tuple[float, float]],
                  prefill: tuple[float, float]) -> tuple[Profile, dict[str, Any]]:
    """The profile with its step models scaled to reproduce measured steps.

    Decode: the drift need not slow every batch size alike (measured here: a batch-4 step
    1.9x the profile's while a batch-1 step was 0.95x), and on this machine's BLAS a step
    is not smooth in the batch size either (one serving probe: batch 3 104 ms, 4 71 ms,
    7 129 ms, 8 87 ms, 11 143 ms, 12 100 ms), so each measured batch size gets its own
    table entry, added where the profile's table has none (its value there
    interpolated first). The context term (the KV read) takes the largest batch's factor,
    measured over modelled; each measured batch's entry then takes the factor that makes
    its step exact, and the profile's other entries the factor interpolated linearly
    between the measured sizes (the nearest one's beyond them). Prefill: one factor,
    measured over modelled. The transfer model, role factor and neighbour slowdown stay
    the profile's.

    Args:
        profile: the profile as measured, with a decode table (`bN` features).
        decode: per batch size, (the measured step in seconds, its tokens attended to).
        prefill: (measured seconds, the profile's modelled seconds) of prompt steps.

    Returns:
        The scaled profile and the record: `factors` (`decode_bN` per measured batch,
        `decode_context`, `prefill`), and per batch and for prefill the `measured_ms` and
        the profile's `profile_ms`.

    Raises:
        ValueError: no decode step, or the profile's decode model has no batch table.
    """
    _check_table(profile)
    if not decode:
        raise ValueError("no decode step was measured")
    modelled = {b: _decode_parts(profile.decode, b, tokens) for b, (_, tokens) in decode.items()}
    largest = max(decode)
    factors = {"decode_context": decode[largest][0] / sum(modelled[largest])}
    for batch in sorted(decode):
        part, context = modelled[batch]
        rest = decode[batch][0] - factors["decode_context"] * context
        factors[f"decode_b{batch}"] = rest / part if part > 0 and rest > 0 \
            else factors["decode_context"]
    factors["prefill"] = prefill[0] / prefill[1]
    probed = sorted(decode)
    record = {"factors": factors,
              "measured_ms": {**{f"decode_b{b}": round(1e3 * decode[b][0], 2) for b in probed},
                              "prefill": round(1e3 * prefill[0], 2)},
              "profile_ms": {**{f"decode_b{b}": round(1e3 * sum(modelled[b]), 2)
                                for b in probed},
                             "prefill": round(1e3 * prefill[1], 2)}}
    return scaled_by(profile, factors), record


def scaled_by(profile: Profile, factors: dict[str, float]) -> Profile:
    """The profile scaled by `scale_profile`'s factors (as its record keeps them): each
    measured batch size's table entry by its factor (added, interpolated, where the table
    has none), the other entries by the factor interpolated between the measured sizes,
    the context term by `decode_context`, the prompt model by `prefill`."""
    features, coef = _check_table(profile)
    table = {int(f[1:]): c for f, c in zip(features, coef, strict=True) if f[0] == "b"}
    probed = sorted(int(k.removeprefix("decode_b")) for k in factors
                    if k.startswith("decode_b"))
    table_factor = [factors[f"decode_b{b}"] for b in probed]
    table |= {b: _decode_parts(profile.decode, b, float(b))[0] for b in probed
              if b not in table}
    sizes = sorted(table)
    others = [(f, c) for f, c in zip(features, coef, strict=True) if f[0] != "b"]
    decode = LinearModel(
        (*(f"b{b}" for b in sizes), *(f for f, _ in others)),
        (*(table[b] * float(np.interp(b, probed, table_factor)) for b in sizes),
         *(c * factors["decode_context"] for _, c in others)))
    return replace(profile, decode=decode, prefill=LinearModel(
        profile.prefill.features, tuple(c * factors["prefill"] for c in profile.prefill.coef)))


def scaled_by_record(profile: Profile, record: dict[str, Any]) -> Profile:
    """The profile as a calibration record scales it: `scaled_by` its `factors`, with the
    record's measured step spread (`scale_to_steps`'s `step_cv`) and serving path's
    latency (a served calibration's `response_latency_ms`) where it has them. For a
    record of this profile, the profile its calibration returned."""
    latency = record.get("response_latency_ms")
    return replace(scaled_by(profile, record["factors"]),
                   step_cv=record.get("step_cv", profile.step_cv),
                   response_latency_s=profile.response_latency_s if latency is None
                   else latency / 1e3)


def _check_table(profile: Profile) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The decode model's features and coefficients, which must include a batch table."""
    features, coef = profile.decode.features, profile.decode.coef
    if not any(f[0] == "b" for f in features):
        raise ValueError(f"the profile's decode model ({', '.join(features)}) has no batch "
                         "table: profile again with this version")
    return features, coef


def _decode_parts(model: LinearModel, batch: int, tokens: float) -> tuple[float, float]:
    """A decode step's modelled seconds: (the batch table's part, the context part)."""
    x = decode_features([tokens / batch] * batch, model.features)
    table = sum(c * v for f, c, v in zip(model.features, model.coef, x, strict=True)
                if f[0] == "b")
    return table, model.predict(x) - table




def why_not_calibrate(profile: Profile) -> str | None:
    """Why `profile` cannot be calibrated on this machine (None: it can): probes time this
    machine's CPU engine, which says nothing of an analytic profile or another machine."""
    from engine.hardware import cpu_features

    here = cpu_features().model
    if profile.hardware.get("analytic"):
        return "an analytic profile has no engine here to probe"
    if profile.hardware.get("gpu"):
        return f"profiled on a GPU ({profile.hardware['gpu']}); the probes run on this CPU"
    if profile.hardware.get("cpu") != here:
        return (f"profiled on {profile.hardware.get('cpu') or 'an unnamed machine'}, "
                f"not on this {here}")
    if not any(f.startswith("b") for f in profile.decode.features):
        return "the profile's decode model has no batch table (profile it again)"
    return None


def calibrate_for_plan(prefill: Profile, decode: Profile
                       ) -> tuple[Profile, Profile, dict[str, Any]]:
    """Both profiles scaled to this machine's speed now (`Calibrator`), or as given with
    the reason.

    Returns:
        The prefill and decode profiles to plan with, and the plan file's `calibration`:
        `{"applied": true, "prefill": record, "decode": record}` (`scale_profile`'s
        records) or `{"applied": false, "reason": ...}`.
    """
    for profile in (prefill, decode):
        if (reason := why_not_calibrate(profile)) is not None:
            return prefill, decode, {"applied": False, "reason": reason}
    scaled_decode, decode_record = Calibrator(decode)()
    if prefill == decode:
        scaled_prefill, prefill_record = scaled_decode, decode_record
    else:
        scaled_prefill, prefill_record = Calibrator(prefill)()
    return scaled_prefill, scaled_decode, {"applied": True, "prefill": prefill_record,
                                           "decode": decode_record}


def calibrate_each(prefills: Sequence[Profile], decodes: Sequence[Profile]
                   ) -> tuple[list[Profile], list[Profile], dict[str, Any]]:
    """Every profile that can be calibrated here scaled to this machine's speed now (each
    distinct one probed once), the others as given.

    Returns:
        The profiles in the same order, and the plan file's `calibration`: `applied`, and
        `records` (one per distinct profile: `scale_profile`'s record, or the reason it
        was not calibrated) or, when none was, the first `reason`.
    """
    done: list[tuple[Profile, Profile, dict[str, Any]]] = []

    def one(profile: Profile) -> Profile:
        for original, scaled, _ in done:
            if original == profile:
                return scaled
        reason = why_not_calibrate(profile)
        scaled, record = (profile, {"reason": reason}) if reason else Calibrator(profile)()
        done.append((profile, scaled, record))
        return scaled

    out = [one(p) for p in prefills], [one(p) for p in decodes]
    records = [record for _, _, record in done]
    if all("reason" in r for r in records):
        return *out, {"applied": False, "reason": records[0]["reason"]}
    return *out, {"applied": True, "records": records}
