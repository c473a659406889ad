"""Two models on one cluster from one YAML file: `smollm2` disaggregated (1 prefill + 1
decode, each pool with its own batch, sequence and KV settings) and `tiny` colocated. Each
answers as its own reference does, over gRPC and the `openai` client (usage in the stream,
logprobs, seed); an unknown model is a 404 / NOT_FOUND naming it; `/v1/models`, `status`
and the metrics show both, and each pool's settings as built; `scale --model` resizes one
model's pools and leaves the other's workers as they were."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import grpc
import httpx
import pytest

from commands.cli import main
from engine import LLM, CacheConfig, SamplingParams, apply_chat_template
from router.client import PdClusterClient
from tests.conftest import SMOL_CHATS, hf_greedy
from tests.e2e.serving import serve

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

GB = 2**30
CONFIG = """
local-prefill-threshold: 0
transport: zmq
dtype: float32  # the references' (auto is bf16 on CPUs with native bf16)
models:
  - model: smollm2
    mode: disaggregated
    prefill:
      replicas: 1
      max-num-batched-tokens: 256
      max-num-seqs: 4
      kv-cache-gb: 0.0625
    decode:  # vLLM's files write underscores: the same keys
      replicas: 1
      max_num_batched_tokens: 128
      max_num_seqs: 8
      kv_cache_gb: 0.125
  - model: tiny
    mode: colocated
    decode:
      replicas: 1
"""
MODELS = ("smollm2", "tiny")


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("models") / "serve.yaml"
    path.write_text(CONFIG)
    with serve("--config", str(path)) as served:
        yield served


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny", dtype="float32", cache=CacheConfig(num_blocks=64))


def _statuses(address: str) -> dict[str, dict]:
    with PdClusterClient(address, timeout=10) as client:
        return {name: client.status(name) for name in MODELS}


def _workers(status: dict) -> dict[str, str]:
    return {w["worker_id"]: role for role, ws in status["pools"].items() for w in ws}


def _pools_free(address: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        workers = [w for s in _statuses(address).values() for ws in s["pools"].values()
                   for w in ws]
        if all(w["num_free_blocks"] == w["num_blocks"] and not w["num_running"]
               for w in workers):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not free: {workers}")
        time.sleep(0.2)


def _openai(served):
    import openai

    return openai.OpenAI(base_url=served.http + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_each_model_answers_as_its_own_reference(two_models, smollm2, tiny):
    messages = [{"role": "user", "content": SMOL_CHATS[0]}]
    prompt = list(range(5, 45))
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with PdClusterClient(two_models.grpc, timeout=120) as client:
        smol = list(client.generate(messages=messages, model="smollm2", max_tokens=16,
                                    temperature=0.0, ignore_eos=True))
        small = list(client.generate(prompt_token_ids=prompt, model="tiny", **params))
        with pytest.raises(grpc.RpcError) as e:
            list(client.generate(prompt="hi", model="nope", max_tokens=2))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'nope' is not served here" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # which of the two: the client must say
            list(client.generate(prompt="hi", max_tokens=2))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model: required" in e.value.details()
    smol_prompt = apply_chat_template(smollm2.tokenizer, messages)
    assert [t for o in smol for t in o.token_ids] == hf_greedy("smollm2", smol_prompt, 16)
    expected = tiny.generate([prompt], SamplingParams(**params))[0].outputs[0].token_ids
    assert [t for o in small for t in o.token_ids] == expected
    _pools_free(two_models.grpc)


def test_openai_surface_on_both_models(two_models, smollm2, tiny):
    """Usage in the stream, logprobs, seed, `/v1/models`, `/tokenize` with each model's chat
    template, and a 404 naming an unknown model, with the official client."""
    import openai

    http = _openai(two_models)
    listed = {m.id: m for m in http.models.list().data}
    assert set(listed) == set(MODELS)
    messages = [{"role": "user", "content": "Name a colour."}]
    for name, llm in (("smollm2", smollm2), ("tiny", tiny)):
        tokenized = httpx.post(two_models.http + "/tokenize", timeout=60,
                               json={"model": name, "messages": messages}).json()
        assert tokenized["tokens"] == apply_chat_template(llm.tokenizer, messages)
        assert tokenized["max_model_len"] == listed[name].max_model_len
        chunks = list(http.chat.completions.create(
            model=name, messages=messages, max_tokens=6, temperature=0.0, logprobs=True,
            top_logprobs=2, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}))
        assert all(c.model == name for c in chunks)
        assert chunks[-1].usage.prompt_tokens == tokenized["count"]
        assert chunks[-1].usage.completion_tokens == 6
        logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs
                    for lp in c.choices[0].logprobs.content]
        assert len(logprobs) == 6
        for lp in logprobs:  # greedy: the chosen token is the likeliest of the top two
            assert len(lp.top_logprobs) == 2
            assert lp.logprob == max(t.logprob for t in lp.top_logprobs) <= 0
        greedy = llm.generate(tokenized["tokens"], SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0].text
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy
        seeded = [http.completions.create(model=name, prompt="Once upon a time",
                                          max_tokens=12, temperature=1.0, seed=11).choices[0]
                  for _ in range(2)]
        assert seeded[0].text == seeded[1].text
        # The fields the request omits (SmolLM2's top_p) take the generation config's
        # defaults on the server and offline alike.
        params = replace(llm.get_default_sampling_params(), temperature=1.0, max_tokens=12,
                         seed=11)
        offline = llm.generate(llm.tokenizer.encode("Once upon a time"),
                               params)[0].outputs[0].text
        assert seeded[0].text == offline
    with pytest.raises(openai.NotFoundError) as e:
        http.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    assert "'nope' is not served here; the models are 'smollm2', 'tiny'" in e.value.message
    _pools_free(two_models.grpc)


def _families(served) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(served.http + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _finished(served) -> dict[str, float]:
    """`pdcluster:requests_finished{finish_reason="length"}` by model."""
    return {s.labels["model_name"]: s.value
            for s in _families(served)["pdcluster:requests_finished"].samples
            if s.name.endswith("_total") and s.labels["finish_reason"] == "length"}


def test_status_and_metrics_per_model(two_models, capsys):
    assert main(["status", "--json", "--address", two_models.grpc]) == 0
    document = json.loads(capsys.readouterr().out)["models"]
    assert {name: (s["mode"], sorted(s["pools"])) for name, s in document.items()} == {
        "smollm2": ("disaggregated", ["decode", "prefill"]), "tiny": ("colocated", ["mixed"])}
    # Each model's sampling defaults: SmolLM2's card's, none for tiny.
    assert {name: (s["generation_config"]["source"], s["generation_config"]["defaults"])
            for name, s in document.items()} == {
        "smollm2": ("auto", {"temperature": 0.2, "top_p": 0.9}), "tiny": ("auto", {})}
    assert main(["status", "--address", two_models.grpc]) == 0
    table = capsys.readouterr().out
    assert "pdcluster · smollm2 · disaggregated" in table
    assert "pdcluster · tiny · colocated" in table
    assert "sampling defaults for omitted fields: temperature 0.2, top_p 0.9" in table
    assert "sampling defaults for omitted fields: none (--generation-config auto)" in table
    families = _families(two_models)
    usage = families["pdcluster:worker_kv_usage"].samples
    by_model = {(s.labels["model_name"], s.labels["role"]) for s in usage}
    assert by_model == {("smollm2", "prefill"), ("smollm2", "decode"), ("tiny", "mixed")}
    waiting = families["pdcluster:num_requests_waiting"].samples
    assert sorted(s.labels["model_name"] for s in waiting) == sorted(MODELS)
    # One request to tiny, two to smollm2: each model's counter moves by its own.
    before = _finished(two_models)
    with PdClusterClient(two_models.grpc, timeout=120) as client:
        for name in ("tiny", "smollm2", "smollm2"):
            list(client.generate(prompt="Hello", model=name, max_tokens=2, temperature=0.0,
                                 ignore_eos=True))
    after = _finished(two_models)
    assert {m: after[m] - before.get(m, 0) for m in MODELS} == {"smollm2": 2, "tiny": 1}
    _pools_free(two_models.grpc)


def test_scale_one_model_leaves_the_other_untouched(two_models, capsys):
    before = _statuses(two_models.grpc)
    assert main(["scale", "--decode", "2", "--address", two_models.grpc]) == 1
    assert "model: required, this server serves several: smollm2, tiny" in \
        capsys.readouterr().err
    assert main(["scale", "--model", "tiny", "--decode", "2", "--address",
                 two_models.grpc]) == 0
    assert "tiny pools now: {'mixed': 2}" in capsys.readouterr().out
    after = _statuses(two_models.grpc)
    assert _workers(after["smollm2"]) == _workers(before["smollm2"])
    assert len(_workers(after["tiny"])) == 2
    assert set(_workers(before["tiny"])) < set(_workers(after["tiny"]))
    with PdClusterClient(two_models.grpc, timeout=120) as client:
        for name in MODELS:  # both still answer
            outs = list(client.generate(prompt="Hello", model=name, max_tokens=4,
                                        temperature=0.0, ignore_eos=True))
            assert sum(len(o.token_ids) for o in outs) == 4
    _pools_free(two_models.grpc)


def test_each_pool_is_built_with_its_own_settings(two_models, smollm2, capsys):
    """`status` (`--json` and the table, piped) shows each of smollm2's pools with the
    file's settings, and what each worker's engine built: its pool's KV budget in blocks.
    Then smollm2 scaled live, prefill 1 -> 0 and decode 1 -> 2: the pools differ, so no
    prefill worker turns decode in place (it would keep its smaller KV pool); a new decode
    worker of the decode pool's spec starts. (Last: it changes smollm2's pools.)"""
    engine = smollm2.engine
    block_bytes = engine.kv_cache.block_bytes * engine.model_config.num_layers  # fp32 KV
    assert main(["status", "--json", "--model", "smollm2", "--address", two_models.grpc]) == 0
    status = json.loads(capsys.readouterr().out)
    settings = status["pool_settings"]
    assert (settings["prefill"]["max_num_batched_tokens"], settings["prefill"]["max_num_seqs"],
            settings["prefill"]["kv_cache_memory_gb"]) == (256, 4, 0.0625)
    assert (settings["decode"]["max_num_batched_tokens"], settings["decode"]["max_num_seqs"],
            settings["decode"]["kv_cache_memory_gb"]) == (128, 8, 0.125)
    (prefill,), (decode,) = status["pools"]["prefill"], status["pools"]["decode"]
    assert prefill["num_blocks"] == int(0.0625 * GB) // block_bytes
    assert decode["num_blocks"] == int(0.125 * GB) // block_bytes

    assert main(["status", "--model", "smollm2", "--address", two_models.grpc]) == 0
    table = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in table.splitlines()
            if line.count("│") >= 3}
    # The cells themselves, prefill then decode ("4" alone would also match "64").
    assert [cell.strip() for cell in rows["max_num_seqs"].split("│")[2:4]] == ["4", "8"]
    assert "…" not in table  # piped: no column cut to fit 80 characters

    tiny_before = _workers(_statuses(two_models.grpc)["tiny"])
    assert main(["scale", "--model", "smollm2", "--prefill", "0", "--decode", "2",
                 "--address", two_models.grpc]) == 0
    assert "pools now" in capsys.readouterr().out
    assert main(["status", "--json", "--model", "smollm2", "--address", two_models.grpc]) == 0
    pools = json.loads(capsys.readouterr().out)["pools"]
    assert not pools.get("prefill")
    decodes = pools["decode"]
    assert len(decodes) == 2
    assert decode["worker_id"] in {w["worker_id"] for w in decodes}
    assert [w["num_blocks"] for w in decodes] == [decode["num_blocks"]] * 2
    assert prefill["worker_id"] not in {w["worker_id"] for w in decodes}
    assert _workers(_statuses(two_models.grpc)["tiny"]) == tiny_before
    _pools_free(two_models.grpc)
