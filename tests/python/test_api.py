"""sparrow's Python API (python/sparrow, docs/python.md) against the engine as the `sparrow` binary runs it:
greedy tokens equal `sparrow generate`'s for every family's fixture (prompts longer than the sparse
budgets); text prompts, n choices and seeds, logprobs and prompt_logprobs in vLLM's shapes, stop strings
and finish reasons, JSON-schema structured outputs, chat through the model's template; update_weights
(from a folder, or from numpy arrays / torch tensors in memory) takes effect on the next call and refuses
another architecture or a tensor that does not fit; bad parameters are errors naming the
field, never a crash."""
from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

import sparrow

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models" / "minimax_m3"
FIXTURES = REPO / "tests" / "fixtures"


@pytest.fixture(scope="module")
def llm() -> sparrow.LLM:
    return sparrow.LLM(str(BUNDLED), kv_cache_memory_bytes=64 << 20)


@pytest.mark.parametrize("family", ["deepseek_v32", "kimi_linear", "kimi_k3_1_pro", "minimax_m3"])
def test_greedy_tokens_are_the_cli_generates(sparrow_binary, family):
    fixture = FIXTURES / family
    prompts = json.loads((fixture / "prompts.json").read_text())["prompts"]
    cli = subprocess.run([sparrow_binary, "generate", "--model", str(fixture), "--prompt-ids",
                          str(fixture / "prompts.json"), "--max-tokens", "10", "--temperature", "0", "--ignore-eos"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    expected = json.loads(cli.stdout)["completions"]
    llm = sparrow.LLM(str(fixture), kv_cache_memory_bytes=64 << 20, max_model_len=4096)
    outputs = llm.generate(prompts, sparrow.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert [o.prompt_token_ids for o in outputs] == prompts


def test_text_prompts_choices_seeds_and_logprobs(llm):
    params = sparrow.SamplingParams(temperature=0.8, n=3, seed=11, max_tokens=8, logprobs=2, prompt_logprobs=1)
    first = llm.generate("def fibonacci(n):", params)
    again = llm.generate(["def fibonacci(n):"], params)
    assert len(first) == 1 and len(first[0].outputs) == 3
    assert [c.token_ids for c in first[0].outputs] == [c.token_ids for c in again[0].outputs], "a seed repeats"
    out = first[0]
    assert out.prompt == "def fibonacci(n):" and out.prompt_token_ids == llm.encode("def fibonacci(n):")
    # vLLM's shapes: prompt_logprobs[0] is None (nothing predicts the first token), then one dict a token.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in entry and entry[token].rank >= 1
    for choice in out.outputs:
        assert len(choice.token_ids) == 8 and choice.finish_reason == "length"
        assert choice.text == llm.decode(choice.token_ids)
        assert len(choice.logprobs) == 8
        total = 0.0
        for token, entry in zip(choice.token_ids, choice.logprobs):
            assert token in entry and 2 <= len(entry) <= 3
            lp = entry[token]
            assert lp.logprob <= 0 and lp.rank >= 1 and lp.decoded_token == llm.decode([token])
            best = max(entry.values(), key=lambda e: e.logprob)
            assert best.rank == 1
            total += lp.logprob
        assert math.isclose(choice.cumulative_logprob, total, rel_tol=1e-5, abs_tol=1e-5)


def test_stops_and_finish_reasons(llm):
    greedy = sparrow.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = llm.generate("def fibonacci(n):", greedy)[0].outputs[0].text
    stop = text[5:8]
    stopped = llm.generate("def fibonacci(n):", greedy.clone(stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[:text.index(stop)]
    token = llm.generate("def fibonacci(n):", greedy)[0].outputs[0].token_ids[3]
    by_id = llm.generate("def fibonacci(n):", greedy.clone(stop_token_ids=[token]))[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == token and by_id.token_ids[-1] == token
    # One set of parameters per prompt.
    two = llm.generate(["a", "b"], [greedy.clone(max_tokens=2), greedy.clone(max_tokens=5)])
    assert [len(o.outputs[0].token_ids) for o in two] == [2, 5]


def test_structured_outputs_follow_the_schema(llm):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    for seed in range(3):
        params = sparrow.SamplingParams(temperature=1.0, seed=seed, max_tokens=80,
                                        structured_outputs={"json": schema})
        text = llm.generate("Describe a person as JSON:", params)[0].outputs[0].text
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and 0 <= value["age"] <= 120
        assert len(value["name"]) <= 8


def test_chat_renders_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is 2 + 2?"}],
                   sparrow.SamplingParams(temperature=0, max_tokens=12))
    assert len(out) == 1 and out[0].outputs[0].token_ids
    two = llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Hello"}]],
                   sparrow.SamplingParams(temperature=0, max_tokens=4))
    assert len(two) == 2 and two[0].prompt_token_ids != two[1].prompt_token_ids


def negate_tensor(folder: Path, name: str) -> None:
    """Flips the sign of every element of one tensor of model.safetensors (bf16 or fp32), in place."""
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    info = header[name]
    begin, end = (8 + header_len + o for o in info["data_offsets"])
    width = {"BF16": 2, "F16": 2, "F32": 4}[info["dtype"]]
    for i in range(begin + width - 1, end, width):
        data[i] ^= 0x80
    path.write_bytes(bytes(data))


def test_update_weights_takes_effect_on_the_next_call(tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(BUNDLED, changed)
    negate_tensor(changed, "lm_head.weight")
    llm = sparrow.LLM(str(BUNDLED), kv_cache_memory_bytes=64 << 20)
    params = sparrow.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    before = llm.generate("def fibonacci(n):", params)[0].outputs[0]
    llm.update_weights(str(changed))
    after = llm.generate("def fibonacci(n):", params)[0].outputs[0]
    assert after.token_ids != before.token_ids, "the negated head picks other tokens"
    llm.update_weights(str(BUNDLED))
    back = llm.generate("def fibonacci(n):", params)[0].outputs[0]
    assert back.token_ids == before.token_ids and back.cumulative_logprob == before.cumulative_logprob
    with pytest.raises(ValueError, match="not the architecture being served"):
        llm.update_weights(str(FIXTURES / "deepseek_v32"))
    assert llm.generate("def fibonacci(n):", params)[0].outputs[0].token_ids == before.token_ids


def stored_tensor(folder: Path, name: str):
    """One tensor of model.safetensors as (numpy array, safetensors dtype); bf16 as uint16 bits."""
    import numpy as np
    data = (folder / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    info = json.loads(data[8:8 + header_len])[name]
    begin, end = (8 + header_len + o for o in info["data_offsets"])
    kind = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[info["dtype"]]
    return np.frombuffer(data[begin:end], dtype=kind).reshape(info["shape"]), info["dtype"]


# An RL trainer's step: new tensors from memory, never written to disk, answer as the folder holding them does.
def test_update_weights_from_memory_is_the_folder_with_those_tensors(tmp_path):
    import numpy as np
    changed = tmp_path / "changed"
    shutil.copytree(BUNDLED, changed)
    negate_tensor(changed, "lm_head.weight")
    params = sparrow.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    expected = sparrow.LLM(str(changed), kv_cache_memory_bytes=64 << 20).generate("def fibonacci(n):", params)[0].outputs[0]
    llm = sparrow.LLM(str(BUNDLED), kv_cache_memory_bytes=64 << 20)
    before = llm.generate("def fibonacci(n):", params)[0].outputs[0]
    head, dtype = stored_tensor(changed, "lm_head.weight")
    llm.update_weights(weights=[("lm_head.weight", head, dtype)] if dtype == "BF16" else {"lm_head.weight": head})
    after = llm.generate("def fibonacci(n):", params)[0].outputs[0]
    assert after.token_ids == expected.token_ids and after.cumulative_logprob == expected.cumulative_logprob
    assert after.token_ids != before.token_ids
    # The same tensor widened to float32 (any of bf16 / f16 / f32 replaces a bf16 one): the same answers.
    wide = head.astype(np.uint32) << 16 if dtype == "BF16" else head.astype(np.float32)
    llm.update_weights(weights={"lm_head.weight": wide.view(np.float32) if dtype == "BF16" else wide})
    assert llm.generate("def fibonacci(n):", params)[0].outputs[0].token_ids == expected.token_ids
    # Bad tensors are refused with their name, and the model being served stays.
    with pytest.raises(ValueError, match="'model.nonexistent.weight' is not a tensor of"):
        llm.update_weights(weights={"model.nonexistent.weight": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="has shape"):
        llm.update_weights(weights={"lm_head.weight": np.zeros((2, 3), np.float32)})
    with pytest.raises(ValueError, match="give it as"):
        llm.update_weights(weights={"lm_head.weight": np.zeros(head.shape, np.uint16)})
    with pytest.raises(ValueError, match="a model folder or weights"):
        llm.update_weights()
    assert llm.generate("def fibonacci(n):", params)[0].outputs[0].token_ids == expected.token_ids


def test_update_weights_from_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    changed = tmp_path / "changed"
    shutil.copytree(BUNDLED, changed)
    negate_tensor(changed, "lm_head.weight")
    params = sparrow.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = sparrow.LLM(str(changed), kv_cache_memory_bytes=64 << 20).generate("def fibonacci(n):", params)[0].outputs[0]
    head, dtype = stored_tensor(changed, "lm_head.weight")
    tensor = torch.from_numpy(head.astype("int32")).to(torch.int16).view(torch.bfloat16) if dtype == "BF16" \
        else torch.from_numpy(head.copy())
    llm = sparrow.LLM(str(BUNDLED), kv_cache_memory_bytes=64 << 20)
    llm.update_weights(weights={"lm_head.weight": tensor})
    assert llm.generate("def fibonacci(n):", params)[0].outputs[0].token_ids == expected.token_ids


def test_bad_input_is_an_error_naming_it(llm):
    with pytest.raises(ValueError, match="temperature"):
        sparrow.SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        sparrow.SamplingParams(top_p=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        sparrow.SamplingParams(temprature=0.5)
    with pytest.raises(ValueError, match="best_of"):
        sparrow.SamplingParams(best_of=2)
    with pytest.raises(ValueError, match="structured_outputs"):
        sparrow.SamplingParams(structured_outputs={"json": "{not json"})
    with pytest.raises(ValueError, match="maximum context length|max_model_len"):
        llm.generate([1] * (llm.max_model_len + 1), sparrow.SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="out of range|vocabulary"):
        llm.generate([[10 ** 7]], sparrow.SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="one set of sampling parameters"):
        llm.generate(["a", "b", "c"], [sparrow.SamplingParams(), sparrow.SamplingParams()])
    with pytest.raises(ValueError, match="not a model folder"):
        sparrow.LLM("/nonexistent/model")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        sparrow.LLM(str(BUNDLED), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="decode_context_parallel_size"):
        sparrow.LLM(str(BUNDLED), decode_context_parallel_size=2)
    # The engine is still fine after every refusal.
    assert llm.generate("ok", sparrow.SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids


def test_speculative_config_gives_the_same_outputs(llm):
    """vLLM's speculative_config: ngram prompt lookup and a draft model (the bundled model drafting for itself)
    give the tokens decoding without speculation gives, greedy and seeded (docs/speculative.md)."""
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    params = [sparrow.SamplingParams(temperature=0, max_tokens=40),
              sparrow.SamplingParams(temperature=0.7, seed=3, max_tokens=40)]
    want = [llm.generate(prompt, p)[0].outputs[0].token_ids for p in params]
    for config in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
                   {"method": "draft_model", "model": str(BUNDLED), "num_speculative_tokens": 3}):
        spec = sparrow.LLM(str(BUNDLED), kv_cache_memory_bytes=64 << 20, speculative_config=config)
        assert [spec.generate(prompt, p)[0].outputs[0].token_ids for p in params] == want, config
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        sparrow.LLM(str(BUNDLED), kv_cache_memory_bytes=64 << 20, speculative_config={"method": "ngram"})
    # The checkpoint's own multi-token-prediction layer (DeepSeek-V3.2's, on its fixture).
    mtp_fixture = FIXTURES / "deepseek_v32_mtp"
    prompts = json.loads((mtp_fixture / "prompts.json").read_text())["prompts"]
    greedy = sparrow.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = sparrow.LLM(str(mtp_fixture), kv_cache_memory_bytes=64 << 20)
    mtp = sparrow.LLM(str(mtp_fixture), kv_cache_memory_bytes=64 << 20,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in mtp.generate(prompts, greedy)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    # A DSpark drafter (Kimi K3's, on its fixture: model/dspark.h).
    k3 = FIXTURES / "kimi_k3_1_pro"
    prompts = json.loads((k3 / "prompts.json").read_text())["prompts"]
    plain = sparrow.LLM(str(k3), kv_cache_memory_bytes=64 << 20)
    dspark = sparrow.LLM(str(k3), kv_cache_memory_bytes=64 << 20,
                         speculative_config={"method": "dspark", "model": str(FIXTURES / "kimi_k3_dspark"),
                                             "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in dspark.generate(prompts, greedy)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]


def test_lora_requests_pick_their_adapter_per_prompt(tmp_path):
    """LoRARequest as vLLM takes it: one for all prompts or one per prompt (None: the base model); the adapted
    answers differ from the base model's, a mixed call answers each prompt as a call of its own adapter does
    (the CPU engine is batch invariant), and adapters load, list and go away. The numerics against merged
    checkpoints are tests/lora_test.cpp's."""
    import sys
    sys.path.insert(0, str(REPO / "tools"))
    from random_lora_adapter import make_adapter
    first = sparrow.LoRARequest("first", 1, str(make_adapter(BUNDLED, tmp_path / "first", rank=4, seed=1)))
    second = sparrow.LoRARequest("second", 2, str(make_adapter(BUNDLED, tmp_path / "second", rank=8, seed=2)))
    llm = sparrow.LLM(str(BUNDLED), kv_cache_memory_bytes=64 << 20, enable_lora=True, max_loras=2)
    params = sparrow.SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17]]

    def logprobs(outputs):
        return [[next(iter(step.values())).logprob for step in o.outputs[0].logprobs] for o in outputs]
    base = logprobs(llm.generate(prompts, params))
    one = logprobs(llm.generate(prompts, params, lora_request=first))
    two = logprobs(llm.generate(prompts, params, lora_request=second))
    assert one != base and two != base and one != two
    mixed = logprobs(llm.generate(prompts * 3, params, lora_request=[None, None, first, first, second, second]))
    assert mixed == base + one + two
    assert sorted(llm.list_loras()) == ["first", "second"]
    third = sparrow.LoRARequest("third", 3, str(make_adapter(BUNDLED, tmp_path / "third", rank=4, seed=3)))
    with pytest.raises(ValueError, match="max_loras"):
        llm.generate(prompts, params, lora_request=third)
    llm.remove_lora("first")
    llm.load_lora(third)
    assert sorted(llm.list_loras()) == ["second", "third"]
    with pytest.raises(ValueError, match="no LoRA adapter 'first'"):
        llm.remove_lora("first")
    with pytest.raises(ValueError, match="enable_lora"):
        sparrow.LLM(str(BUNDLED), kv_cache_memory_bytes=64 << 20).generate(prompts, params, lora_request=first)


def test_batch_invariant_mode(tmp_path):
    """batch_invariant=True (the CLI's --batch-invariant, core/batch_invariance.h) is accepted and, on the CPU
    where every forward pass is batch invariant anyway, changes nothing: a batch of prompts gives each the
    logprobs it gets alone, and the score of a sampled sequence (prompt_logprobs over prompt + completion)
    gives the logprobs recorded while sampling it. The GPU's mode is tests/cuda/batch_invariance_gpu_test.cpp's."""
    llm = sparrow.LLM(str(BUNDLED), kv_cache_memory_bytes=64 << 20, batch_invariant=True)
    params = sparrow.SamplingParams(temperature=0.8, seed=7, max_tokens=6, logprobs=1, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17], list(range(20, 60))]

    def sampled(outputs):
        return [(o.outputs[0].token_ids, [o.outputs[0].logprobs[i][t].logprob for i, t in
                                          enumerate(o.outputs[0].token_ids)]) for o in outputs]
    together = sampled(llm.generate(prompts, params))
    alone = [sampled(llm.generate([p], params))[0] for p in prompts]
    assert together == alone
    score = sparrow.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    for prompt, (tokens, logprobs) in zip(prompts, alone):
        scored = llm.generate([prompt + tokens], score)[0].prompt_logprobs
        assert [scored[len(prompt) + i][t].logprob for i, t in enumerate(tokens)] == logprobs


def test_images_in_generate_and_chat(sparrow_binary, tmp_path):
    """Images (docs/vision.md) on the MiniMax-M3-VL fixture: multi_modal_data (a PIL image, file bytes, a path) on
    ids holding one placeholder per image gives the expanded ids `sparrow generate` answers the same way; a chat's
    image_url parts (data: URLs) are rendered by the template and placed as the server places them."""
    import base64

    PIL = pytest.importorskip("PIL.Image")
    fixture = FIXTURES / "minimax_m3_vl"
    images = REPO / "tests" / "data" / "images"
    if not (images / "rgb_97x61.png").exists():
        pytest.skip("tests/data/images is not in this copy of the tree")
    first, second = images / "rgb_97x61.png", images / "downscaled_203x151.jpg"
    # Room for MiniMax-M3's chat template (its fixed system text is ~900 of this byte tokenizer's tokens).
    folder = tmp_path / "model"
    folder.mkdir()
    for f in fixture.iterdir():
        if f.is_file() and f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((fixture / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 4096
    (folder / "config.json").write_text(json.dumps(config))
    llm = sparrow.LLM(str(folder), kv_cache_memory_bytes=64 << 20, limit_mm_per_prompt={"image": 2})
    greedy = sparrow.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    ids = [17, 42, 250, 99, 3, 250, 128]  # one placeholder per image
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [PIL.open(first), second.read_bytes()]}},
                       greedy)[0]
    expanded = out.prompt_token_ids
    assert expanded == [17, 42, 248] + [250] * 6 + [249, 99, 3, 248] + [250] * 6 + [249, 128]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"ids": expanded, "images": [str(first), str(second)]}]}))
    cli = subprocess.run([sparrow_binary, "generate", "--model", str(folder), "--prompt-ids", str(prompts),
                          "--max-tokens", "3", "--temperature", "0", "--ignore-eos"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["completions"][0] == out.outputs[0].token_ids
    # A path works as well as bytes.
    again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [str(first), str(second)]}}, greedy)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids

    url = "data:image/png;base64," + base64.b64encode(first.read_bytes()).decode()
    chat = llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                   {"type": "image_url", "image_url": {"url": url}}]}], greedy)[0]
    assert chat.prompt_token_ids.count(250) == 6 and chat.prompt_token_ids.count(248) == 1

    with pytest.raises(ValueError, match="at most 2 image"):
        llm.generate({"prompt_token_ids": ids + [250], "multi_modal_data": {"image": [str(first)] * 3}}, greedy)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt_token_ids": [17, 42], "multi_modal_data": {"image": str(first)}}, greedy)
    with pytest.raises(ValueError, match="image"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [b"not an image", str(second)]}}, greedy)
    with pytest.raises(ValueError, match="images only"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": [b""]}}, greedy)
    text_only = sparrow.LLM(str(BUNDLED), kv_cache_memory_bytes=64 << 20)
    with pytest.raises(ValueError, match="takes no images"):
        text_only.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": str(first)}}, greedy)


def test_kimi_k3_images_in_generate_and_chat(sparrow_binary, tmp_path):
    """Kimi K3's tower (tests/fixtures/kimi_k3_vl): ids with one <|kimi_image_placeholder|> (251) per image become
    "<|media_begin|>image {w}x{h}<|media_content|>", the <|media_pad|> (250) run and <|media_end|>, answered as
    `sparrow generate` answers the expanded ids; a chat's image_url part is rendered by Kimi K3's template."""
    import base64
    fixture = FIXTURES / "kimi_k3_vl"
    images = REPO / "tests" / "data" / "images"
    if not (images / "rgb_97x61.png").exists():
        pytest.skip("tests/data/images is not in this copy of the tree")
    first, second = images / "rgb_97x61.png", images / "downscaled_203x151.jpg"
    llm = sparrow.LLM(str(fixture), kv_cache_memory_bytes=64 << 20)
    greedy = sparrow.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [17, 251, 99, 251, 3],
                        "multi_modal_data": {"image": [str(first), second.read_bytes()]}}, greedy)[0]
    expanded = out.prompt_token_ids
    text = lambda s: [ord(c) - 31 for c in s]  # the fixture's byte tokens for printable ASCII
    assert expanded == ([17, 247] + text("image 97x61") + [248] + [250] * 12 + [249, 99, 247] + text("image 203x151") +
                        [248] + [250] * 20 + [249, 3])
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"ids": expanded, "images": [str(first), str(second)]}]}))
    cli = subprocess.run([sparrow_binary, "generate", "--model", str(fixture), "--prompt-ids", str(prompts),
                          "--max-tokens", "3", "--temperature", "0", "--ignore-eos"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["completions"][0] == out.outputs[0].token_ids
    url = "data:image/png;base64," + base64.b64encode(first.read_bytes()).decode()
    chat = llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                   {"type": "image_url", "image_url": {"url": url}}]}], greedy)[0]
    assert chat.prompt_token_ids.count(250) == 12 and 251 not in chat.prompt_token_ids
