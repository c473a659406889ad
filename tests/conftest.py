"""Shared fixtures: the tiny and SmolLM2 models, Hugging Face references, pool checks."""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, CacheConfig, LLMEngine
from engine.model_loader import resolve_model_dir

# The conversations every SmolLM2-vs-transformers check uses (unit and end to end), so the
# slow `transformers` reference for each is computed once per session (`hf_greedy` caches).
SMOL_CHATS = [
    "What is the capital of France?",
    "Write a short poem about the sea and the wind at night.",
    "Explain in two sentences why the sky is blue during the day.",
]


@functools.cache
def hf_model(name: str) -> torch.nn.Module:
    """The Hugging Face `transformers` implementation on the same weights, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(name), dtype=torch.float32)
    return model.eval()


def hf_greedy(name: str, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by `transformers` (argmax each step, EOS not special): the oracle."""
    return list(_hf_greedy(name, tuple(prompt_token_ids), max_tokens))


@functools.cache
def _hf_greedy(name: str, prompt_token_ids: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    model = hf_model(name)
    ids = torch.tensor([prompt_token_ids])
    out: list[int] = []
    past = None
    with torch.inference_mode():
        for _ in range(max_tokens):
            result = model(ids, cache=past, use_cache=True)
            past = result.cache
            out.append(int(result.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return tuple(out)


# Fixtures that start the router's gRPC and HTTP servers in this process: a test using any
# of them (directly or through another fixture) is marked `server`.
SERVER_FIXTURES = {"shared_servers", "make_servers", "tiny_servers", "smollm2_servers", "dying"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
    # The longest modules first (hosts in namespaces, then `serve` processes, then Ray
    # clusters): `make test`'s two processes take whole modules in this order, so the
    # short ones fill in last and neither process runs a long module alone at the end.
    # Each module's tests keep their order.
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        rank[module] = min(rank.get(module, len(_LONGEST_FIRST)), next(
            (i for i, m in enumerate(_LONGEST_FIRST) if item.get_closest_marker(m)),
            len(_LONGEST_FIRST)))
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


_LONGEST_FIRST = ("multinode", "e2e", "cluster")


# In CI (`.ci/run` sets PDCLUSTER_STRICT_SKIPS=1) a test that cannot run its subject (no
# network namespaces, no Mooncake, no shell) fails instead of skipping: a regression there
# must not pass as one more "skipped". Two reasons stay skips, each named in the skip list
# CI prints last: what only a GPU runs, and kernel variants of ISA levels the CPU lacks
# (they are compiled in CI all the same; `test_kernels.py` checks the build holds them).
STRICT_SKIPS_ENV = "PDCLUSTER_STRICT_SKIPS"
# With it set, every skip is appended to this file (`nodeid: reason`) for CI's list.
SKIP_LIST_ENV = "PDCLUSTER_SKIP_LIST"
CUDA_ONLY = "CUDA only: "
CPU_LACKS = "CPU lacks "
ALLOWED_SKIPS = (CUDA_ONLY, CPU_LACKS)


# The PDCLUSTER_* variables a test run itself needs; every other one is a serve flag's
# value (`PDCLUSTER_<FLAG>`), which a test of the command line clears first.
RUN_ENV = ("PDCLUSTER_CACHE", STRICT_SKIPS_ENV, SKIP_LIST_ENV, "PDCLUSTER_CPU_ISA")


def clear_flag_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove the serve flags' `PDCLUSTER_*` variables from the environment (for this
    test): the command line under test reads only what the test sets."""
    for name in [k for k in os.environ if k.startswith("PDCLUSTER_") and k not in RUN_ENV]:
        monkeypatch.delenv(name)


def cpu_lacks(level: str) -> str:
    """The skip reason of a test of an ISA level this CPU does not run."""
    return f"{CPU_LACKS}{level}"


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    _strict_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield  # a module that skips itself as a whole (tests/multinode/)
    _strict_skip(outcome.get_result())


def _strict_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """List a skip, and fail it under `STRICT_SKIPS_ENV` unless its reason is allowed."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if os.environ.get(SKIP_LIST_ENV):
        with open(os.environ[SKIP_LIST_ENV], "a") as out:
            out.write(f"{report.nodeid}: {reason}\n")
    if os.environ.get(STRICT_SKIPS_ENV) == "1" and not reason.startswith(ALLOWED_SKIPS):
        report.outcome = "failed"
        report.longrepr = (f"skipped in CI ({STRICT_SKIPS_ENV}=1), where every test must run "
                           f"its subject: {reason}")


def assert_pool_free(engine: LLMEngine) -> None:
    """Nothing running, nothing held: every block back in the free queue."""
    pool = engine.block_pool
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.scheduler.parked
    assert pool.num_free_blocks == pool.num_blocks
    assert all(count == 0 for count in pool.ref_cnt)


def truncated_model(src: Path, dst: Path, num_layers: int) -> Path:
    """A model directory holding `src`'s first `num_layers` layers: its config with fewer
    layers, the embeddings, those layers, the final norm and the tokenizer (the LM head is
    tied). It computes what an early exit of `src` after those layers computes."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    assert config["tie_word_embeddings"]
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config))
    state = load_file(src / "model.safetensors")
    save_file({name: t for name, t in state.items() if not name.startswith("model.layers.")
               or int(name.split(".")[2]) < num_layers}, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="session", autouse=True)
def _tokenizer_parsed_once_per_model() -> Iterator[None]:
    """Every engine built in this process gets its own copy of a tokenizer parsed once per
    model directory: parsing tokenizer.json is 90 % of building a tiny engine, and the
    tests build a hundred. Copies share nothing, so no engine sees another's state."""
    import engine.llm_engine as llm_engine

    parse = functools.cache(llm_engine.load_tokenizer)  # the real one, patched below
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_engine, "load_tokenizer",
                      lambda model_dir: copy.deepcopy(parse(str(model_dir))))
        yield


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    return str(resolve_model_dir("tiny"))


@pytest.fixture(scope="session")
def smollm2() -> LLM:
    """SmolLM2 loaded once per session: the offline engine of the unit tests, the reference
    of the end-to-end tests, and (behind the router, on an engine thread the module stops
    again) the engine of the router's structured-output tests. Whoever uses it leaves its
    pool free."""
    llm = LLM("smollm2", cache=CacheConfig(num_blocks=256))
    yield llm
    assert_pool_free(llm.engine)


@pytest.fixture
def root_logging():
    """The process's logging as it was after the test (`configure_logging` replaces the
    root logger's handler and routes Python's warnings into it)."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    logging.captureWarnings(False)
