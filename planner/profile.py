"""A worker type's measured performance: step-time models, KV transfer cost, KV capacity.

`pdcluster profile` (planner/profiler.py) measures the real engine and writes a
`pdcluster.profile/1` JSON file; the simulator reads it. Step time is modelled by two
least-squares linear models over features of the step's schedule, fitted on raw samples
and checked on held-out ones:

- a step that computes any prompt tokens (prefill, chunk, or a colocated mixed step):
  `const + tokens + attention + seqs`, where `tokens` is every token computed (the linear
  layers), `attention` the query x key pairs in thousands (sum over requests of
  new tokens x (context before + (new + 1) / 2)), and `seqs` the requests in the step;
- a decode-only step: one term per profiled batch size (`b1`, `b2`, ... interpolated
  linearly between them) plus `context`, the tokens attended to in thousands (the KV
  read). A table, not a line in the batch size: on CPU BLAS the linears' cost is not
  monotonic in the rows (measured on OpenBLAS 0.3.31's Haswell kernels: a 2-row sgemm
  costs more than a 4-row one), and the small batches are the common ones. Profiles
  written before have `const + seqs + context`; both forms are read.

The exposed KV transfer (end of prefill to the request joining the decode batch, the part
layer-wise streaming does not hide) is `const + blocks` in the shipped blocks.
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.scheduler import step_work

SCHEMA = "pdcluster.profile/1"
PREFILL_FEATURES = ("const", "tokens", "attention", "seqs")
# Batch sizes a full profile times decode steps at (the decode model's table).
DECODE_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
LINEAR_DECODE_FEATURES = ("const", "seqs", "context")  # the older, linear decode model
TRANSFER_FEATURES = ("const", "blocks")
# A sample this much slower (as a fraction) than the first fit predicts is an outlier.
OUTLIER = 0.5


@dataclass(frozen=True)
class LinearModel:
    """Seconds as a non-negative linear combination of named features.

    Args:
        features: the feature names (`const` is the constant 1).
        coef: one coefficient per feature.
    """

    features: tuple[str, ...]
    coef: tuple[float, ...]

    def predict(self, x: Sequence[float]) -> float:
        """The model's value for one feature vector (same order as `features`)."""
        if len(x) != len(self.coef):
            raise ValueError(f"{len(x)} feature values for {len(self.coef)} coefficients")
        return float(sum(map(operator.mul, self.coef, x)))


def fit(features: Sequence[str], xs: Sequence[Sequence[float]], ys: Sequence[float]
        ) -> LinearModel:
    """Least squares on relative error with every coefficient >= 0 (a step cannot get
    faster with more work).

    Each sample's row is divided by its time: timing noise is multiplicative, and a 5 ms
    decode step matters as much to latency predictions as a 500 ms prefill. A feature
    whose unconstrained coefficient comes out negative is dropped and the rest refitted,
    until all are non-negative (the active-set idea of NNLS, enough for a handful of
    features). Samples more than `OUTLIER` slower than the first fit predicts (a step
    another process interrupted) are then left out and the model refitted once.

    Raises:
        ValueError: fewer samples than features, or a sample of no time.
    """
    a, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] < a.shape[1]:
        raise ValueError(f"need at least {len(features)} samples to fit {list(features)}, "
                         f"got {len(ys)}")
    if (y <= 0).any():
        raise ValueError("every sample must take a positive time")
    a, y = a / y[:, None], np.ones_like(y)
    coef = _nonnegative_lstsq(a, y)
    # Relative to the sample's own time, a row of `a @ coef` is predicted / measured.
    kept = a @ coef >= 1 / (1 + OUTLIER)
    if not kept.all() and kept.sum() >= a.shape[1]:
        coef = _nonnegative_lstsq(a[kept], y[kept])
    return LinearModel(tuple(features), tuple(float(c) for c in coef))


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        solution = np.linalg.lstsq(a[:, active], y, rcond=None)[0]
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return coef


def relative_errors(model: LinearModel, xs: Sequence[Sequence[float]], ys: Sequence[float]
                    ) -> dict[str, float]:
    """Absolute relative error of `model` on samples: median, p90 and max."""
    errors = [abs(model.predict(x) - y) / y for x, y in zip(xs, ys, strict=True) if y > 0]
    if not errors:
        raise ValueError("no samples to score the fit on")
    return {"median": float(np.median(errors)), "p90": float(np.percentile(errors, 90)),
            "max": float(max(errors)), "num_samples": len(errors)}


def fit_held_out(features: Sequence[str], xs: Sequence[Sequence[float]], ys: Sequence[float],
                 seed: int = 0) -> tuple[LinearModel, dict[str, float]]:
    """Fit on a random three quarters of the samples, score on the other quarter, refit on all.

    Returns:
        The model fitted on every sample, and its held-out error (`relative_errors`).
    """
    order = np.random.default_rng(seed).permutation(len(ys))
    num_test = max(len(ys) // 4, 1)
    test, train = order[:num_test], order[num_test:]
    held = fit(features, [xs[i] for i in train], [ys[i] for i in train])
    error = relative_errors(held, [xs[i] for i in test], [ys[i] for i in test])
    return fit(features, xs, ys), error


def prefill_features(items: Sequence[tuple[int, int]]) -> tuple[float, ...]:
    """Features of a step with prompt tokens; `items` are (context before, new tokens)."""
    return work_features(*step_work([(start, n, True) for start, n in items]))


def work_features(tokens: float, pairs: float, seqs: float) -> tuple[float, ...]:
    """The prompt-step model's features from a step's work (`engine.scheduler.step_work`:
    tokens, query x key pairs, requests). The model is linear, so work summed over steps
    and divided by their count gives the mean step's features."""
    return (1.0, float(tokens), pairs / 1e3, float(seqs))


def decode_feature_names(batches: Sequence[int]) -> tuple[str, ...]:
    """The decode model's features for a table of these batch sizes."""
    return (*(f"b{b}" for b in sorted(set(batches))), "context")


def decode_features(contexts: Sequence[int], features: Sequence[str]) -> tuple[float, ...]:
    """Features of a decode-only step, in the order of `features`.

    Args:
        contexts: each request's tokens attended to.
        features: the model's names: `bN` (the batch-size table: the step's batch as
            linear-interpolation weights over the table's sizes, extrapolated from the two
            largest beyond them), `const`, `seqs`, `context` (thousands of tokens).
    """
    return decode_work_features(len(contexts), sum(contexts), features)


def decode_work_features(batch: int, context: float, features: Sequence[str]
                         ) -> tuple[float, ...]:
    """`decode_features` from a decode step's batch size and its contexts' sum."""
    sizes = [int(f[1:]) for f in features if f[0] == "b"]
    weights = _batch_weights(batch, sizes) if sizes else {}
    values = {"const": 1.0, "seqs": float(batch), "context": context / 1e3}
    return tuple(weights.get(int(f[1:]), 0.0) if f[0] == "b" else values[f] for f in features)


def _batch_weights(batch: int, sizes: Sequence[int]) -> dict[int, float]:
    """`batch` as a linear combination of the table's sizes (ascending)."""
    if batch in sizes:
        return {batch: 1.0}
    if len(sizes) == 1 or batch < sizes[0]:
        return {sizes[0]: batch / sizes[0]}
    hi = next((i for i, s in enumerate(sizes) if s > batch), len(sizes) - 1)
    lo, hi = sizes[hi - 1], sizes[hi]
    t = (batch - lo) / (hi - lo)
    return {lo: 1.0 - t, hi: t}


@dataclass(frozen=True)
class Profile:
    """One worker type on one machine (see the module docstring).

    Args:
        model: the model as given to `--model`.
        model_id: what identifies its weights' shape (architecture and sizes), to refuse
            a profile of another model.
        dtype: model dtype.
        torch_threads: intra-op threads the engine ran with.
        hardware: CPU model and flags, cores, GPU name.
        block_size: tokens per KV block.
        num_blocks: KV blocks for `kv_cache_gb`.
        kv_cache_gb: the KV budget profiled.
        block_bytes: bytes of one block over all layers.
        max_model_len: longest prompt + output.
        transport: the KV transport measured.
        load_time_s: seconds to build the engine (model load and KV allocation).
        prefill: step-time model of steps with prompt tokens.
        decode: step-time model of decode-only steps.
        transfer: exposed KV transfer time against shipped blocks.
        prefill_role_factor: a prefill worker's step time over the step model's (KV
            streaming runs inside its steps).
        neighbour_slowdown: how much slower (as a fraction) a step runs while another
            worker on the same host is stepping: they share memory bandwidth, caches and,
            on a small host, cores with the router. Measured with one neighbour; the
            simulator adds it once per busy neighbour.
        workers_per_host: workers of this type that fit one host of the profiled machine
            (its cores over `torch_threads`); the simulator places workers on hosts in
            this many.
        step_cv: how much one step's time varies about the model's (coefficient of
            variation): the machine, the interpreter, the BLAS. The simulator draws each
            step's time from a log-normal of mean 1 and this spread (0: exact times).
        response_latency_s: what the serving path adds to the time a client sees each
            token, beyond the engine's steps (the gRPC stream, the router, the hop to the
            worker, the CPU they share with busy workers). 0 as measured or modelled (a
            profile times bare steps); a served calibration measures it
            (`commands.serving_calibration.response_latency`). The simulator adds it to
            every first and last token: TTFT and end-to-end latency grow by it, TPOT not.
        fit_error: held-out relative error of each model.
        samples: the raw samples, per model: `{"x": [...], "y": seconds}`.
        schema: the file format version.
    """

    model: str
    model_id: str
    dtype: str
    torch_threads: int
    hardware: dict[str, Any]
    block_size: int
    num_blocks: int
    kv_cache_gb: float
    block_bytes: int
    max_model_len: int
    transport: str
    load_time_s: float
    prefill: LinearModel
    decode: LinearModel
    transfer: LinearModel
    prefill_role_factor: float = 1.0
    neighbour_slowdown: float = 0.0
    workers_per_host: int = 1
    step_cv: float = 0.0
    response_latency_s: float = 0.0
    fit_error: dict[str, dict[str, float]] = field(default_factory=dict)
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    schema: str = SCHEMA

    def step_time(self, items: Sequence[tuple[int, int, bool]]) -> float:
        """Seconds for one engine step.

        Args:
            items: per scheduled request (context before the step, new tokens, whether
                the tokens are prompt tokens).
        """
        context = 0
        for start, n, is_prompt in items:
            if is_prompt:
                return self.prefill.predict(work_features(*step_work(items)))
            context += start + n
        return self.decode_time(len(items), context)

    def decode_time(self, batch: int, context: int) -> float:
        """Seconds for one decode-only step of `batch` requests attending to `context`
        tokens in all (their contexts' sum)."""
        features = self.decode.features
        if "context" not in features:  # not a form `pdcluster profile` writes
            return self.decode.predict(decode_work_features(batch, context, features))
        parts = self._decode_parts.get(batch)
        if parts is None:  # the same few batch sizes recur every step
            values, at = decode_work_features(batch, 0, features), features.index("context")
            parts = self._decode_parts[batch] = (values[:at], values[at + 1:])
        before, after = parts
        return self.decode.predict((*before, context / 1e3, *after))

    @functools.cached_property
    def _decode_parts(self) -> dict[int, tuple[tuple[float, ...], tuple[float, ...]]]:
        """Batch size -> the decode model's feature values before and after `context`."""
        return {}

    def transfer_time(self, num_blocks: int) -> float:
        """Exposed seconds to ship `num_blocks` blocks of KV to a decode worker."""
        return self.transfer.predict((1.0, float(num_blocks)))

    def transfer_links_to(self, decode: Profile) -> float:
        """How many times longer the wire part of this (prefill) profile's transfer takes
        to a worker of `decode`'s: an analytic profile ships a request's KV over
        min(TP, KV heads) links in parallel (`StepModel.transfer_time`), each rank its
        heads over its own NIC; to a decode worker of fewer ranks only as many links
        receive it (its ranks take every head between them). 1 for measured profiles (one
        process, one link) and for equal or larger decode TPs; from a larger TP to a
        smaller the sender's own links are still the limit."""
        tp = int(self.hardware.get("tp", 1))
        heads = int(self.hardware.get("kv_heads", tp))
        sending = min(tp, heads)
        return sending / min(sending, int(decode.hardware.get("tp", 1)))

    def save(self, path: Path) -> None:
        """Write the profile as JSON."""
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> Profile:
        """Read a profile file.

        Raises:
            ValueError: not a readable `pdcluster.profile/1` file; the message says why.
        """
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"profile {path}: cannot read it: {e}") from e
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"profile {path}: schema is {found!r}, expected {SCHEMA!r} "
                             "(write one with `pdcluster profile`)")
        try:
            models = {key: LinearModel(tuple(data[key]["features"]), tuple(data[key]["coef"]))
                      for key in ("prefill", "decode", "transfer")}
            return cls(**{**data, **models})
        except (KeyError, TypeError) as e:
            raise ValueError(f"profile {path}: malformed: {e}") from e


def check_same_model(profiles: Sequence[Profile], model: str | None = None) -> None:
    """Refuse profiles of different models (or not of `model`, when given).

    Raises:
        ValueError: names both models.
    """
    for p in profiles:
        if p.model_id != profiles[0].model_id:
            raise ValueError(f"profiles are of different models: {profiles[0].model} "
                             f"({profiles[0].model_id}) and {p.model} ({p.model_id})")
        if model is not None and p.model != model:
            raise ValueError(f"the profile is of model {p.model!r}, not {model!r}: "
                             f"profile {model!r} with `pdcluster profile --model {model}`")
