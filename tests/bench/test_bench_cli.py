"""`pdcluster bench` end to end against real gRPC and OpenAI HTTP servers over a tiny engine."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import cli
from bench.report import compare_reports, load_report
from bench.traces import WorkloadSpec, arrival_times, make_workload
from protocol.serving import Slo, TraceRequest, write_trace
from router.servers import Servers

WORKLOAD = ["--num-requests", "8", "--rate", "20", "--prompt-len", "16:48",
            "--output-len", "1:6", "--seed", "5"]
# An SLO that splits the requests whatever the machine: a one-token answer has no TPOT and
# meets any TPOT bound, a longer one never has a TPOT of 1 us (a decode step alone takes
# longer). The workload's seed gives 2 one-token answers of 8: attainment exactly 2/8.
SPLITTING_SLO = "ttft=60000,tpot=0.001"
SPLIT = 2 / 8


def target(backend: str, servers: Servers) -> list[str]:
    if backend == "grpc":
        return ["--backend", "grpc", "--address", f"127.0.0.1:{servers.grpc_port}"]
    return ["--backend", "openai", "--base-url", f"http://127.0.0.1:{servers.http_port}/v1"]


def expected_workload() -> list[TraceRequest]:
    spec = WorkloadSpec(prompt_len=(16, 48), output_len=(1, 6), seed=5)
    return make_workload(spec, arrival_times(8, 20.0, seed=5))


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_bench_run_writes_a_valid_report(backend: str, servers: Servers, tmp_path: Path) -> None:
    out = tmp_path / backend
    argv = [*target(backend, servers), *WORKLOAD, "--slo", SPLITTING_SLO,
            "--out", str(out), "--label", backend]
    assert cli.main(argv) == 0

    report = load_report(out / "report.json")
    expected = expected_workload()
    summary = report["summary"]
    assert (summary["num_requests"], summary["completed"], summary["failed"]) == (8, 8, 0)
    assert summary["total_prompt_tokens"] == sum(r.prompt_len for r in expected)
    assert summary["total_output_tokens"] == sum(r.output_len for r in expected)
    assert [r.output_len for r in expected].count(1) == SPLIT * 8
    assert summary["figures"]["attainment"] == SPLIT
    assert summary["figures"]["goodput_rps"] == pytest.approx(
        summary["request_throughput"] * SPLIT)
    for stats in (summary[key] for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")):
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]

    for record, request in zip(report["requests"], expected, strict=True):
        assert record["arrival"] == pytest.approx(request.timestamp)
        assert record["finish_reason"] == "length" and record["error"] is None
        assert record["prompt_tokens"] == request.prompt_len
        assert record["max_tokens"] == record["output_tokens"] == request.output_len
        if backend == "grpc":  # gRPC messages carry their token ids, so counts are exact
            assert sum(n for _, n in record["chunks"]) == request.output_len
            # and the last one the router's clocks: one engine, no prefill worker, no KV
            # moved; the router's first token and end come before the client's
            server = record["server"]
            assert server["prefill"] == server["transfer"] == 0.0
            assert 0 <= server["queue"] < server["ttft"] <= server["e2e"]
            assert server["ttft"] < record["chunks"][0][0] - record["send"]
            assert server["e2e"] < record["finish"] - record["send"]
        else:  # the OpenAI API has no field for them
            assert record["server"] is None
    if backend == "grpc":
        parts = summary["breakdown"]
        assert parts["requests"] == 8
        assert parts["ms"]["prefill"]["p99"] == parts["ms"]["kv_transfer"]["p99"] == 0.0
        assert sum(parts["share"].values()) == pytest.approx(1.0)
        assert sum(stats["mean"] for stats in parts["ms"].values()) == pytest.approx(
            summary["e2e_ms"]["mean"])
    else:
        assert summary["breakdown"] is None

    tokens_per_s = report["throughput_over_time"]["output_tokens_per_s"]
    assert len(tokens_per_s) == math.ceil(summary["duration_s"])
    assert report["config"]["backend"] == backend and report["label"] == backend
    # Over OpenAI the model was not given, so the server's own listing named it.
    assert report["config"]["model"] == (None if backend == "grpc" else "tiny")
    for name in ("latency_cdf.png", "throughput.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    assert [json.loads(line)["prompt_token_ids"] for line in
            (out / "trace.jsonl").read_text().splitlines()] == \
        [r.prompt_token_ids for r in expected]


@pytest.mark.parametrize(("backend", "error"), [("grpc", "INVALID_ARGUMENT: prompt"),
                                                ("openai", "HTTP 400: prompt")])
def test_rejected_requests_count_as_failed(backend: str, error: str, servers: Servers,
                                           tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    # The tiny model's context is 1024 tokens, so the second prompt is refused.
    write_trace(trace, [TraceRequest(0.0, 2, [200] * 8), TraceRequest(0.0, 2, [200] * 2000)])
    out = tmp_path / "out"
    assert cli.main([*target(backend, servers), "--trace", str(trace), "--out", str(out)]) == 1
    records = load_report(out / "report.json")["requests"]
    assert [r["finish_reason"] for r in records] == ["length", None]
    assert records[1]["error"].startswith(error)
    assert load_report(out / "report.json")["summary"]["failed"] == 1


def test_unreachable_server_fails_every_request(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, [TraceRequest(0.0, 2, [200] * 4)])
    # Port 1 on loopback: nothing listens there.
    argv = ["--address", "127.0.0.1:1", "--trace", str(trace), "--request-timeout", "5"]
    assert cli.main(argv) == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-requests", "2"], "--backend grpc needs --address"),
    (["--backend", "openai"], "--backend openai needs --base-url"),
    (["--address", "127.0.0.1:1", "--trace", "t.jsonl", "--rate", "2"],
     "--rate: not with --trace"),
    (["--address", "127.0.0.1:1", "--burstiness", "2"], "need --rate"),
    (["--address", "127.0.0.1:1", "--rate", "2", "--arrival", "fixed", "--burstiness", "2"],
     "--burstiness sets gamma"),
    (["--address", "127.0.0.1:1", "--workload", "mixed", "--prompt-len", "4:8"],
     "do not apply to the mixed workload"),
])
def test_flag_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_flag_values_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--prompt-len", "9:3"], ["--slo", "ttft=soon"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
    assert "must be a number of ms" in capsys.readouterr().err


def test_registers_as_a_pdcluster_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="pdcluster")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--address", "127.0.0.1:1", "--rate", "3",
                              "--burstiness", "2", "--slo", "ttft=100", "--prompt-len", "8"])
    assert args.func is cli.run
    assert (args.rate, args.burstiness, args.prompt_len) == (3.0, 2.0, (8, 8))
    assert args.slo == Slo({"ttft_ms": 100.0})


def test_runs_as_a_module() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.cli", "--help"], capture_output=True,
                          text=True, timeout=60, check=True)
    assert "--max-concurrency" in done.stdout


def report(label: str, **summary: Any) -> dict[str, Any]:
    return {"schema": "pdcluster.bench/1", "label": label, "summary": summary}


def test_compare_reports_gives_ratios_to_the_first(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    base = report("vllm", output_throughput=50.0, ttft_ms={"mean": 200.0, "p99": 400.0},
                  failed=0)
    other = report("pd", output_throughput=75.0, ttft_ms={"mean": 100.0, "p99": 500.0},
                   failed=2)
    rows = {row["metric"]: row for row in compare_reports([base, other])}
    assert rows["output throughput (tok/s)"]["ratios"] == [1.0, 1.5]
    assert rows["TTFT mean (ms)"]["ratios"] == [1.0, 0.5]
    assert rows["TTFT p99 (ms)"]["values"] == [400.0, 500.0]
    assert rows["goodput (req/s)"]["values"] == [None, None]
    assert rows["failed requests"]["ratios"] == [None, None]

    paths = []
    for data in (base, other):
        paths.append(tmp_path / f"{data['label']}.json")
        paths[-1].write_text(json.dumps(data))
    assert cli.main(["--compare", *map(str, paths)]) == 0
    assert "75 (1.5x)" in capsys.readouterr().out


def test_vllm_flags_and_result_json(servers: Servers, tmp_path: Path) -> None:
    """`vllm bench serve`'s spelling of the run, and its result file, field for field."""
    argv = [*target("openai", servers), "--num-prompts", "8", "--request-rate", "20",
            "--burstiness", "4", "--prompt-len", "16:48", "--output-len", "1:6", "--seed", "5",
            "--goodput", "ttft:60000", "tpot:0.001", "--percentile-metrics", "ttft,tpot,e2el",
            "--metric-percentiles", "50,99.9", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "vllm.json", "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    result = json.loads((tmp_path / "vllm.json").read_text())
    report = load_report(tmp_path / "out" / "report.json")
    summary = report["summary"]
    assert (result["completed"], result["failed"], result["num_prompts"]) == (8, 0, 8)
    assert (result["request_rate"], result["burstiness"]) == (20.0, 4.0)
    assert result["total_output_tokens"] == summary["total_output_tokens"]
    assert result["request_throughput"] == pytest.approx(summary["request_throughput"])
    assert result["output_lens"] == [r.output_len for r in expected_workload()]
    assert result["request_goodput"] == pytest.approx(summary["request_throughput"] * SPLIT)
    assert result["output_lens"] == [r["output_tokens"] for r in report["requests"]]
    assert len(result["ttfts"]) == len(result["itls"]) == len(result["latencies"]) == 8
    assert result["mean_ttft_ms"] == pytest.approx(summary["ttft_ms"]["mean"])
    assert result["median_ttft_ms"] == pytest.approx(summary["ttft_ms"]["p50"])
    assert result["p50_tpot_ms"] <= result["p99.9_tpot_ms"]
    assert result["mean_e2el_ms"] == pytest.approx(summary["e2e_ms"]["mean"])
    assert "mean_itl_ms" not in result  # not among --percentile-metrics
    assert 1 <= result["max_concurrent_requests"] <= 8


def test_burstiness_is_the_gamma_shape_as_in_vllm() -> None:
    """Shape k gives gaps with CV 1/sqrt(k): k = 4 is smoother than Poisson, 0.25 burstier."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    cvs = {}
    for shape in ("0.25", "1", "4"):
        args = parser.parse_args(["--rate", "10", "--burstiness", shape, "--seed", "3"])
        gaps = [b - a for a, b in zip(cli._arrivals(args, 4001), cli._arrivals(args, 4001)[1:],
                                      strict=False)]
        mean = sum(gaps) / len(gaps)
        cvs[shape] = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
        assert mean == pytest.approx(0.1, rel=0.1)
    assert cvs["0.25"] == pytest.approx(2.0, rel=0.15)
    assert cvs["1"] == pytest.approx(1.0, rel=0.1)
    assert cvs["4"] == pytest.approx(0.5, rel=0.1)
    args = parser.parse_args(["--rate", "10", "--burstiness", "inf"])
    assert cli._arrivals(args, 3) == pytest.approx([0.0, 0.1, 0.2])


@pytest.mark.parametrize(("argv", "message"), [
    (["--goodput", "ttft=100"], "expected KEY:MS"),
    (["--goodput", "itl:5"], "expected KEY:MS"),
    (["--goodput", "ttft:100", "--slo", "ttft=100"], "give one of them"),
])
def test_goodput_errors(argv: list[str], message: str,
                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--address", "127.0.0.1:1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_vllm_result_peaks_use_vllm_one_second_buckets() -> None:
    """As vLLM counts them: a request is active in every one-second bucket it touches, so two
    back-to-back requests under a cap of one both count in the second they meet."""
    from bench.loadgen import LoadResult, RequestRecord
    from bench.report import vllm_result

    first = RequestRecord(0, 0.0, 3, prompt_tokens=5, send=0.1, chunks=[(0.2, 1), (0.3, 1),
                          (0.9, 1)], finish=0.95, output_tokens=3, finish_reason="length")
    second = RequestRecord(1, 0.0, 2, prompt_tokens=5, send=0.96, chunks=[(1.15, 1), (1.18, 1)],
                           finish=1.2, output_tokens=2, finish_reason="length")
    result = vllm_result(LoadResult([first, second], 1.3), {}, ("ttft",), (50,), None)
    assert result["max_concurrent_requests"] == 2
    assert result["max_output_tokens_per_s"] == 3.0  # 3 tokens in [0.1, 1.1), 2 after
    assert result["ttfts"] == pytest.approx([0.1, 0.19])
    assert result["median_ttft_ms"] == pytest.approx(145.0)
    assert result["request_goodput"] is None and result["completed"] == 2
