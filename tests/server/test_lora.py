"""LoRA adapters through the OpenAI API (issue 29, docs/lora.md): `--enable-lora --lora-modules NAME=PATH`
serves the adapter under its own model name; /v1/models lists it with the base model as parent; a request
naming it is answered by the adapted model (and says so in `model`), one naming the base model by the base
model, both in the same server at once; an unknown name is a 404; flags and adapter folders that cannot be
served stop the start-up with one line. The numerics (adapter against its merged checkpoint, mixed batches,
the prefix cache) are tests/lora_test.cpp's."""
from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from sparrow_server import API_KEY, MODEL_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from random_lora_adapter import make_adapter  # noqa: E402

@pytest.fixture(scope="module")
def lora_server(start_server, model_dir, tmp_path_factory):
    adapters = tmp_path_factory.mktemp("adapters")
    first = make_adapter(model_dir, adapters / "first", rank=4, seed=1)
    second = make_adapter(model_dir, adapters / "second", rank=8, seed=2)
    server = start_server("--api-key", API_KEY, "--enable-lora", "--lora-modules", f"first={first}",
                          json.dumps({"name": "second", "path": str(second)}), "--max-loras", "2",
                          "--max-lora-rank", "8")
    return server, first, second


def completion(server, model: str, prompt: list[int]):
    return server.client().completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=1)


def test_models_lists_the_adapters_with_the_base_model_as_parent(lora_server):
    server, first, second = lora_server
    listed = {m["id"]: m for m in httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                                            timeout=10).json()["data"]}
    assert set(listed) == {MODEL_NAME, "first", "second"}, listed
    assert listed["first"]["parent"] == MODEL_NAME and listed["first"]["root"] == str(first)
    assert listed["second"]["parent"] == MODEL_NAME and listed["second"]["root"] == str(second)
    assert listed[MODEL_NAME]["parent"] is None
    assert "LoRA adapter 'first' (rank 4" in server.output()


def test_each_model_name_gets_its_own_answers_at_the_same_time(lora_server):
    server, _, _ = lora_server
    prompt = list(range(3, 40))
    alone = {name: completion(server, name, prompt) for name in (MODEL_NAME, "first", "second")}
    for name, response in alone.items():
        assert response.model == name
    logprobs = {name: r.choices[0].logprobs.token_logprobs for name, r in alone.items()}
    assert logprobs["first"] != logprobs[MODEL_NAME] and logprobs["second"] != logprobs[MODEL_NAME]
    assert logprobs["first"] != logprobs["second"]
    # All three at once, several times over: each answers exactly as it did alone.
    names = [MODEL_NAME, "first", "second"] * 3
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        together = list(pool.map(lambda n: completion(server, n, prompt), names))
    for name, response in zip(names, together):
        assert response.choices[0].text == alone[name].choices[0].text, name
        assert response.choices[0].logprobs.token_logprobs == logprobs[name], name
    # Chat too: the response names the adapter.
    chat = server.client().chat.completions.create(model="second", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, temperature=0)
    assert chat.model == "second"


def test_an_unknown_model_name_is_a_404(lora_server):
    server, _, _ = lora_server
    response = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": "third", "prompt": [5, 6], "max_tokens": 2}, timeout=10)
    assert response.status_code == 404 and "third" in response.json()["error"]["message"], response.text


def start_error(sparrow_binary: str, model_dir: Path, *flags: str) -> str:
    result = subprocess.run([sparrow_binary, "serve", str(model_dir), "--port", "0", "--kv-cache-memory", "64MiB",
                             *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_what_cannot_be_served_stops_the_start_with_one_line(sparrow_binary, model_dir, tmp_path):
    good = make_adapter(model_dir, tmp_path / "good", rank=4)
    assert "--lora-modules needs --enable-lora" in start_error(sparrow_binary, model_dir, "--lora-modules", f"a={good}")
    assert "more than --max-loras 1" in start_error(sparrow_binary, model_dir, "--enable-lora", "--lora-modules",
                                                    f"a={good}", f"b={good}")
    assert "named twice" in start_error(sparrow_binary, model_dir, "--enable-lora", "--max-loras", "2",
                                        "--lora-modules", f"a={good}", f"a={good}")
    assert "expected NAME=PATH" in start_error(sparrow_binary, model_dir, "--enable-lora", "--lora-modules", str(good))
    assert "rank 4 is above --max-lora-rank 2" in start_error(sparrow_binary, model_dir, "--enable-lora",
                                                              "--max-lora-rank", "2", "--lora-modules", f"a={good}")
    dora = make_adapter(model_dir, tmp_path / "dora", rank=4, extra={"use_dora": True})
    assert "DoRA" in start_error(sparrow_binary, model_dir, "--enable-lora", "--lora-modules", f"a={dora}")
    assert "is not a folder" in start_error(sparrow_binary, model_dir, "--enable-lora", "--lora-modules",
                                            f"a={tmp_path / 'missing'}")


@pytest.mark.parametrize("layout", [(), ("-dp", "2")])
def test_adapters_load_and_unload_at_run_time(start_server, model_dir, tmp_path, monkeypatch, layout):
    """vLLM's runtime routes, on with VLLM_ALLOW_RUNTIME_LORA_UPDATING: a loaded adapter is served under its
    name and answers as the same folder given at start does; an unloaded one is a 404 again. Under -dp 2 the
    other group's leader loads the adapter from the source its requests bring."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    folder = make_adapter(model_dir, tmp_path / "late", rank=4, seed=5)
    server = start_server("--api-key", API_KEY, "--enable-lora", "--max-loras", "2", *layout)
    reference = start_server("--api-key", API_KEY, "--enable-lora", "--lora-modules", f"late={folder}")
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def post(path, body):
        return httpx.post(server.url + path, headers=headers, json=body, timeout=60)
    prompt = list(range(3, 30))
    assert post("/v1/completions", {"model": "late", "prompt": prompt, "max_tokens": 2}).status_code == 404
    loaded = post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(folder)})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'late' added successfully.", loaded.text
    want = completion(reference, "late", prompt)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # at once, so that both groups take some under -dp
        for got in pool.map(lambda _: completion(server, "late", prompt), range(4)):
            assert got.model == "late"
            assert got.choices[0].logprobs.token_logprobs == want.choices[0].logprobs.token_logprobs
    if layout:
        assert server.metrics()['sparrow:data_parallel_requests_total{group="1"}'] >= 1
    assert "late" in {m["id"] for m in httpx.get(server.url + "/v1/models", headers=headers, timeout=10).json()["data"]}
    again = post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(folder)})
    assert again.status_code == 400 and "already been loaded" in again.text, again.text
    bad = post("/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(tmp_path / "missing")})
    assert bad.status_code == 400 and "is not a folder" in bad.text, bad.text
    assert post("/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert post("/v1/completions", {"model": "late", "prompt": prompt, "max_tokens": 2}).status_code == 404
    missing = post("/v1/unload_lora_adapter", {"lora_name": "late"})
    assert missing.status_code == 404 and "cannot be found" in missing.text, missing.text
    reference.stop()
    server.stop()


def test_runtime_routes_are_off_without_the_switch(lora_server):
    server, _, _ = lora_server
    response = httpx.post(server.url + "/v1/load_lora_adapter", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"lora_name": "x", "lora_path": "/tmp"}, timeout=10)
    assert response.status_code == 404, response.text


# Tensor parallel: each rank keeps the part of an adapter's A or B its weights' split says (rows of B where the
# weight's output is split, columns of A where its input is), the workers loading theirs when a step first
# needs the adapter. Two ranks answer as one process does, for the base model and two adapters at once.
# Under -dcp 2 the two ranks also share out the MLA cache by token, which the adapters' terms do not touch.
# Under -dp 2 each group's leader loads its own copy of an adapter from the source its requests bring (and
# with -tp 2 its worker its part of that).
TP2 = ("--tensor-parallel-size", "2")
@pytest.mark.parametrize("family,layout", [("deepseek_v32", TP2), ("kimi_k3_1_pro", TP2), ("minimax_m3", TP2),
                                           ("deepseek_v32", TP2 + ("-dcp", "2")), ("kimi_k3_1_pro", TP2 + ("-dcp", "2")),
                                           ("deepseek_v32", ("-dp", "2")),
                                           ("minimax_m3", TP2 + ("-dp", "2", "--enable-expert-parallel"))])
def test_several_ranks_serve_adapters_as_one_process_does(start_server, test_model, tmp_path, family, layout):
    model = test_model(family)
    first = make_adapter(model, tmp_path / "a", rank=4, seed=7)
    second = make_adapter(model, tmp_path / "b", rank=8, seed=8)
    flags = ("--api-key", API_KEY, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
             f"a={first}", f"b={second}")
    single = start_server(*flags, model=model)
    sharded = start_server(*flags, *layout, model=model)
    jobs = [(name, list(range(3, 3 + n))) for name in (MODEL_NAME, "a", "b") for n in (5, 40, 90)]
    want = {job_key(j): completion(single, *j) for j in jobs}
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = dict(zip(map(job_key, jobs), pool.map(lambda j: completion(sharded, *j), jobs)))
    for key, response in got.items():
        expected = want[key].choices[0]
        assert response.choices[0].text == expected.text, key
        for g, w in zip(response.choices[0].logprobs.token_logprobs, expected.logprobs.token_logprobs):
            assert abs(g - w) < 5e-3, (key, g, w)  # the base model's own TP sums reach 1e-3 (K3.1 Pro, 90 tokens)
    assert want[("a", 40)].choices[0].logprobs.token_logprobs != want[(MODEL_NAME, 40)].choices[0].logprobs.token_logprobs
    if "-dp" in layout:  # the second group answered some of them, adapters among them
        metrics = sharded.metrics()
        assert min(metrics[f'sparrow:data_parallel_requests_total{{group="{g}"}}'] for g in (0, 1)) >= 2, metrics
    for server in (sharded, single):
        assert server.stop() == 0, server.output()


# The routed experts' adapters too: under -tp each rank keeps its part of every expert's pairs (B's rows of
# gate and up, A's columns of down); under expert parallelism a rank applies its own experts' pairs.
# Refused with one line under data parallelism, where another group's ranks run this group's tokens.
@pytest.mark.parametrize("family,layout", [("deepseek_v32", TP2), ("minimax_m3", TP2 + ("--enable-expert-parallel",))])
def test_routed_expert_adapters_split_as_their_experts_do(start_server, test_model, tmp_path, family, layout):
    model = test_model(family)
    adapter = make_adapter(model, tmp_path / "e", rank=4, seed=9, routed_experts=True)
    flags = ("--api-key", API_KEY, "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"e={adapter}")
    single = start_server(*flags, model=model)
    sharded = start_server(*flags, *layout, model=model)
    for n in (5, 90):
        prompt = list(range(3, 3 + n))
        want, got = completion(single, "e", prompt), completion(sharded, "e", prompt)
        assert got.choices[0].text == want.choices[0].text, n
        for g, w in zip(got.choices[0].logprobs.token_logprobs, want.choices[0].logprobs.token_logprobs):
            assert abs(g - w) < 5e-3, (n, g, w)
    base = completion(single, MODEL_NAME, list(range(3, 93)))
    assert base.choices[0].logprobs.token_logprobs != want.choices[0].logprobs.token_logprobs
    for server in (sharded, single):
        assert server.stop() == 0, server.output()


def test_routed_expert_adapters_are_refused_under_data_parallelism(sparrow_binary, test_model, tmp_path):
    model = test_model("deepseek_v32")
    adapter = make_adapter(model, tmp_path / "e", rank=4, routed_experts=True)
    result = subprocess.run([sparrow_binary, "serve", str(model), "--port", "0", "--kv-cache-memory", "64MiB", "-dp", "2",
                             "--enable-lora", "--lora-modules", f"e={adapter}"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stdout + result.stderr
    # Each group's leader reads the flags' adapters, so each may say it before the run ends.
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert lines and all("not applied under data parallelism" in line for line in lines), result.stderr


def job_key(job):
    return job[0], len(job[1])
