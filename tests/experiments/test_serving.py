"""The pure parts of `experiments.serving` (workloads, SLO derivation, tables, ladder flags), of
`bench.run` (utilization) and of `commands.launch` (the server-process wrapper on a stand-in
process); no cluster, no model."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.loadgen import LoadResult, RequestRecord
from bench.report import build_report
from bench.run import utilization_summary
from bench.serving_metrics import summarize
from commands.launch import READY_LINE, ManagedProcess
from experiments import serving as ex
from protocol.defaults import MAX_QUEUE, MAX_RUNNING


def record(index: int, ttft_s: float, tpot_s: float, num_tokens: int = 5,
           error: str | None = None) -> RequestRecord:
    """A request sent at 0 whose tokens came one per chunk at exactly these latencies."""
    chunks = [(ttft_s + i * tpot_s, 1) for i in range(num_tokens)]
    return RequestRecord(index, 0.0, num_tokens, 10, 0.0, chunks, chunks[-1][0], num_tokens,
                         None if error else "length", error)


def unloaded_report(records: list[RequestRecord], classes: list[str] | None) -> dict[str, Any]:
    """A report as a run writes it and `load_report` reads it back (JSON round trip)."""
    duration = max(r.finish for r in records)
    config = {} if classes is None else {"request_classes": classes}
    report = build_report("unloaded", config, summarize(records, duration),
                          LoadResult(records, duration))
    return json.loads(json.dumps(report))


def test_derive_slo_scales_the_slowest_class_p50s() -> None:
    records = [record(0, 2.0, 0.02), record(1, 0.1, 0.05), record(2, 3.0, 0.03),
               record(3, 0.2, 0.07), record(4, 10.0, 0.04)]
    classes = ["long-prompt", "long-output", "long-prompt", "long-output", "long-prompt"]
    report = unloaded_report(records, classes)

    latency = ex.unloaded_latency(report)
    assert latency["long-prompt"] == pytest.approx(
        {"ttft_ms": 3000.0, "tpot_ms": 30.0, "num_requests": 3})
    assert latency["long-output"] == pytest.approx(
        {"ttft_ms": 150.0, "tpot_ms": 60.0, "num_requests": 2})
    slo = ex.derive_slo(report, ttft_factor=3.0, tpot_factor=2.0)
    assert set(slo.bounds) == {"ttft_ms", "tpot_ms"}  # per-request bounds only
    assert slo.bounds["ttft_ms"] == pytest.approx(9000.0)  # 3 x the long prompts' p50 TTFT
    assert slo.bounds["tpot_ms"] == pytest.approx(120.0)  # 2 x the long answers' p50 TPOT


def test_derive_slo_without_classes_takes_one_p50() -> None:
    report = unloaded_report([record(0, 1.0, 0.01), record(1, 2.0, 0.03),
                              record(2, 4.0, 0.02)], None)
    slo = ex.derive_slo(report, 2.0, 1.5)
    assert slo.bounds == pytest.approx({"ttft_ms": 4000.0, "tpot_ms": 30.0})
    assert slo.attainment == 0.9  # the default target: derive_slo sets bounds only


def test_derive_slo_refuses_an_unloaded_run_with_a_failure() -> None:
    report = unloaded_report([record(0, 1.0, 0.01), record(1, 1.0, 0.01, error="boom")],
                             ["a", "a"])
    with pytest.raises(ValueError, match=r"requests \[1\] failed"):
        ex.derive_slo(report, 3.0, 2.0)
    with pytest.raises(ValueError, match="factors must be > 0"):
        ex.derive_slo(unloaded_report([record(0, 1.0, 0.01)], None), 0.0, 2.0)


def test_build_mix_is_seeded_and_each_class_keeps_its_lengths() -> None:
    classes = ex.pd_mix(length_scale=0.5)
    timestamps = [0.1 * i for i in range(200)]
    requests, labels = ex.build_mix(classes, timestamps, seed=7)

    again, labels_again = ex.build_mix(classes, timestamps, seed=7)
    assert (again, labels_again) == (requests, labels)
    assert ex.build_mix(classes, timestamps, seed=8)[0] != requests
    assert [r.timestamp for r in requests] == pytest.approx(timestamps)
    assert 60 < labels.count("long-prompt") < 140
    for request, label in zip(requests, labels, strict=True):
        if label == "long-prompt":
            assert 512 <= request.prompt_len <= 1024 and 8 <= request.output_len <= 16
        else:
            assert 32 <= request.prompt_len <= 64 and 64 <= request.output_len <= 128
    # Classes draw from different seeds: no prompt starts like one of the other class.
    heads = {tuple(r.prompt_token_ids[:16]) for r, c in zip(requests, labels, strict=True)
             if c == "long-prompt"}
    assert not any(tuple(r.prompt_token_ids[:16]) in heads
                   for r, c in zip(requests, labels, strict=True) if c == "long-output")


def test_ladder_mix_shares_prefixes_and_probe_is_round_robin() -> None:
    classes = ex.ladder_mix(length_scale=0.25)
    requests, labels = ex.build_mix(classes, [0.0] * 60, seed=1)
    shared = [r.prompt_token_ids[:192] for r, c in zip(requests, labels, strict=True)
              if c == "shared-prefix"]
    assert len(shared) > 10 and len({tuple(p) for p in shared}) <= 4

    probe, probe_labels = ex.probe_mix(classes, 2, seed=1)
    assert probe_labels == ["shared-prefix", "long-prompt", "long-output"] * 2
    assert all(r.timestamp == 0.0 for r in probe)


def worker(worker_id: str, role: str, uptime: float, busy: float, wait: float, flops: float,
           nbytes: float, steps: int = 0) -> dict[str, Any]:
    return {"worker_id": worker_id, "role": role, "uptime_s": uptime, "busy_seconds": busy,
            "transfer_wait_seconds": wait, "flops": flops, "bytes": nbytes,
            "peak_flops": 1e11, "peak_bandwidth": 1e10, "num_steps": steps}


def test_utilization_between_uses_the_counters_over_the_window() -> None:
    before = {"pools": {"prefill": [worker("p0", "prefill", 100.0, 10.0, 0.0, 0.0, 0.0)],
                        "decode": [worker("d0", "decode", 100.0, 5.0, 1.0, 0.0, 0.0)]}}
    after = {"pools": {"prefill": [worker("p0", "prefill", 110.0, 18.0, 0.0, 5e11, 1e10, 16)],
                       "decode": [worker("d0", "decode", 110.0, 7.0, 3.0, 1e11, 5e10),
                                  worker("d1", "decode", 3.0, 1.0, 0.0, 0.0, 0.0)]}}
    util = utilization_summary(before, after)

    assert set(util["workers"]) == {"p0", "d0"}  # d1 started inside the window: no baseline
    assert util["workers"]["p0"]["steps"] == 16
    assert util["workers"]["p0"]["mean_step_ms"] == pytest.approx(500.0)  # 8 s busy / 16
    assert util["workers"]["d0"]["mean_step_ms"] is None  # no step in the window
    assert util["by_role"]["prefill"] == pytest.approx(
        {"busy": 0.8, "transfer_wait": 0.0, "idle": 0.2, "flops_utilization": 0.5,
         "bandwidth_utilization": 0.1})
    assert util["by_role"]["decode"] == pytest.approx(
        {"busy": 0.2, "transfer_wait": 0.2, "idle": 0.6, "flops_utilization": 0.1,
         "bandwidth_utilization": 0.5})
    assert util["mean"]["busy"] == pytest.approx(0.5)
    assert utilization_summary(None, after) is None


def metrics(rate: float, goodput: float | None, ttft_p90: float = 1000.0) -> dict[str, Any]:
    return {"rate": rate, "completed": 10, "failed": 0, "request_throughput": 0.5,
            "output_throughput": 40.0, "goodput_rps": goodput, "attainment": 0.75,
            "ttft_p50_ms": 500.0, "ttft_p90_ms": ttft_p90, "tpot_p50_ms": 40.0,
            "tpot_p90_ms": 55.5}


def test_sweep_rows_pair_rates_and_divide_disaggregated_by_colocated() -> None:
    colocated = [metrics(0.1, 0.1), metrics(0.2, 0.0), metrics(0.3, 0.2)]
    disaggregated = [metrics(0.1, 0.1), metrics(0.2, 0.15), metrics(0.4, 0.3)]
    rows = ex.sweep_rows(colocated, disaggregated)

    assert [row["rate"] for row in rows] == [0.1, 0.2]  # 0.3 and 0.4 ran in one mode only
    assert rows[0]["goodput_ratio"] == pytest.approx(1.0)
    assert rows[1]["goodput_ratio"] is None  # colocated met no SLO: no ratio
    lines = ex.sweep_markdown(rows).splitlines()
    assert lines[0].startswith("| rate (req/s) | goodput C (req/s) | goodput D (req/s) | D / C")
    assert lines[1] == "| :--- |" + " ---: |" * 8
    assert lines[2] == ("| 0.1 | 0.1 | 0.1 | 1x | 75% | 75% | 1000.0 / 1000.0 | 55.5 / 55.5 "
                        "| 40 / 40 |")
    assert lines[3].split(" | ")[3] == "-"


def test_ladder_markdown_ratios_to_the_previous_step() -> None:
    steps = [{"title": "static batching", "metrics": metrics(0.3, 0.1),
              "utilization_mean": {"busy": 0.9, "transfer_wait": 0.0, "idle": 0.1,
                                   "flops_utilization": 0.05, "bandwidth_utilization": 0.25}},
             {"title": "continuous batching", "metrics": metrics(0.3, 0.25),
              "utilization_mean": None}]
    lines = ex.ladder_markdown(steps).splitlines()
    assert lines[2] == ("| static batching | 0.5 | 40 | 0.1 | - | 75% | 0 | 1000.0 | 55.5 "
                        "| 90% | 0.0% | 10% | 5.0% | 25% |")
    assert lines[3].split(" | ")[4] == "2.5x"
    assert lines[3].endswith("| - | - | - | - | - |")


def test_ladder_steps_add_one_technique_each() -> None:
    steps = ex.ladder_steps(max_running=6, max_queue=3)
    assert [s.name for s in steps] == ["static", "continuous", "admission", "prefix-caching",
                                       "disaggregation", "int8-kv", "speculative"]

    def flag(step: ex.LadderStep, name: str) -> str | None:
        flags = list(step.flags)
        return flags[flags.index(name) + 1] if name in flags else None

    assert [flag(s, "--policy") for s in steps] == ["static"] + ["continuous"] * 6
    assert ["--no-prefix-caching" in s.flags for s in steps] == [True] * 3 + [False] * 4
    # The unbounded steps run with serve's own admission defaults.
    assert [flag(s, "--max-running") for s in steps] == [str(MAX_RUNNING)] * 2 + ["6"] * 5
    assert [flag(s, "--max-queue") for s in steps] == [str(MAX_QUEUE)] * 2 + ["3"] * 5
    assert [flag(s, "--mode") for s in steps] == ["colocated"] * 4 + ["disaggregated"] * 3
    assert [flag(s, "--kv-cache-dtype") for s in steps] == [None] * 5 + ["int8"] * 2
    assert ["--speculative-config" in s.flags for s in steps] == [False] * 6 + [True]
    assert all(flag(s, "--torch-threads") == "1" for s in steps)
    assert all(flag(s, "--dtype") == "float32" for s in steps)


def test_bench_serve_rows_pair_each_run_of_each_load_across_servers() -> None:
    runs = {"pdcluster": [{"run": 1, "rate": 0.1, **metrics(0.1, 0.09)},
                          {"run": 1, "rate": 0.25, **metrics(0.25, 0.2)}],
            "pdcluster-colocated": [{"run": 1, "rate": 0.1, **metrics(0.1, 0.06)},
                                    {"run": 1, "rate": 0.25, **metrics(0.25, 0.1)}],
            "vllm": [{"run": 1, "rate": 0.1, **metrics(0.1, 0.0)},
                     {"run": 1, "rate": 0.25, **metrics(0.25, 0.05)}]}
    rows = ex.bench_serve_rows(runs)
    assert [(r["rate"], r["run"]) for r in rows] == [(0.1, 1), (0.25, 1)]
    assert rows[0]["ratios"] == {"pdcluster / vLLM": None,  # vLLM met nothing: no ratio
                                 "pdcluster / vLLM fp32": None,  # not run
                                 "disagg. / coloc.": pytest.approx(1.5)}
    assert rows[1]["ratios"]["pdcluster / vLLM"] == pytest.approx(4.0)
    assert rows[1]["ratios"]["disagg. / coloc."] == pytest.approx(2.0)
    lines = ex.bench_serve_markdown(rows, ["pdcluster", "pdcluster-colocated", "vllm"]
                                    ).splitlines()
    assert lines[0] == ("| req/s | run | pdcluster goodput / att. | pdcluster-colocated goodput"
                        " / att. | vllm goodput / att. | pdcluster / vLLM | disagg. / coloc. |")
    assert lines[3] == "| 0.25 | 1 | 0.2 / 75% | 0.1 / 75% | 0.05 / 75% | 4x | 2x |"


def test_bench_serve_servers_run_at_their_defaults_with_pdcluster_told_the_slo(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slo = ex.Slo.parse(ex.BENCH_SERVE_SLO)
    servers = {s.name: s for s in ex.bench_serve_servers(slo)}
    assert list(servers) == ["pdcluster", "pdcluster-colocated", "vllm", "vllm-fp32"]
    told = ("--slo", "ttft_p90_ms=10000,tpot_p90_ms=150")
    assert servers["pdcluster"].flags == ("--prefill", "1", "--decode", "1", *told)
    assert servers["pdcluster-colocated"].flags == ("--mode", "colocated", "--decode", "2",
                                                    *told)
    # No dtype, thread or KV flag: each server's own defaults.
    assert (servers["vllm"].dtype, servers["vllm-fp32"].dtype) == (None, "float32")
    # vLLM's servers need its venv, refused before anything starts; a bad name is named.
    argv = ["bench-serve", "--vllm-python", str(tmp_path / "missing" / "python"),
            "--out", str(tmp_path)]
    assert ex.main(argv) == 2
    assert "leave the vLLM servers out (--servers pdcluster,pdcluster-colocated)" in \
        capsys.readouterr().err
    assert ex.main([*argv, "--servers", "pdcluster,sglang"]) == 2
    assert "--servers: unknown sglang; choose from pdcluster," in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_vs_vllm_without_its_venv_fails_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["vs-vllm", "--vllm-python", str(tmp_path / "missing" / "python"),
            "--out", str(tmp_path)]
    assert ex.main(argv) == 2
    assert "make setup-vllm" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    assert ex.main(["ladder", "--num-unloaded", "0", "--out", str(tmp_path)]) == 2
    assert "needs --slo" in capsys.readouterr().err


def test_managed_process_reads_the_ready_line_and_kills_a_stubborn_process(
        tmp_path: Path) -> None:
    script = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "print('pdcluster ready: gRPC 127.0.0.1:5  OpenAI http://127.0.0.1:6/v1  "
              "metrics x', flush=True); time.sleep(60)")
    log = tmp_path / "logs" / "serve.log"
    with ManagedProcess("stand-in", [sys.executable, "-c", script], log,
                        ready_pattern=READY_LINE) as proc:
        match = proc.wait_ready(lambda: proc.ready_match, timeout=30)
        assert (match[1], match[2]) == ("127.0.0.1:5", "http://127.0.0.1:6")
        assert proc.stop(grace_s=0.2) == -9  # ignored SIGINT, so killed
    assert "pdcluster ready" in log.read_text()


def test_managed_process_reports_an_early_exit_with_its_log(tmp_path: Path) -> None:
    script = "import sys; print('error: unrecognized arguments: --policy'); sys.exit(2)"
    with ManagedProcess("stand-in", [sys.executable, "-c", script], tmp_path / "log",
                        ready_pattern=READY_LINE) as proc, \
            pytest.raises(RuntimeError, match=re.compile(
                r"exited with status 2.*unrecognized arguments: --policy", re.S)):
        proc.wait_ready(lambda: proc.ready_match, timeout=30)
