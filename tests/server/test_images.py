"""Images through the OpenAI chat and Responses APIs (issue 30, docs/vision.md), served from tests/fixtures/minimax_m3_vl (a
MiniMax-M3-VL checkpoint with its vision tower, a 256-token tokenizer and MiniMax-M3's chat template:
tools/make_vl_tokenizers.py), and at the end from tests/fixtures/kimi_k3_vl (Kimi K3 with MoonViT, Kimi K3's template). An image_url part with a data: URL is rendered as the template's image
placeholder and expanded into the image's tokens; the answer is the one `sparrow generate` gives for the same ids
and images (whose numerics tests/minimax_m3_vision_test.cpp checks against the reference); a repeated image hits
the prefix cache; every bad image is a 400 and leaves the server serving."""
from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import httpx
import pytest

from sparrow_server import API_KEY, MODEL_NAME

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "minimax_m3_vl"
IMAGES = REPO / "tests" / "data" / "images"
FIRST, SECOND = IMAGES / "rgb_97x61.png", IMAGES / "downscaled_203x151.jpg"
IMAGE, BEGIN, END = 250, 248, 249  # the fixture tokenizer's ]<]image[>[, ]<]start of image[>[, ]<]end of image[>[


def data_url(path: Path, media_type: str | None = None) -> str:
    media_type = media_type or ("image/png" if path.suffix == ".png" else "image/jpeg")
    return f"data:{media_type};base64," + base64.b64encode(path.read_bytes()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat_body(*urls: str, text: str = "Which is brighter?", **extra) -> dict:
    content = [{"type": "text", "text": "Look: "}] + [image_part(u) for u in urls] + [{"type": "text", "text": text}]
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 3,
            "temperature": 0, "return_token_ids": True, **extra}


def post(server, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory) -> Path:
    """The fixture with room for MiniMax-M3's chat template, whose fixed system text alone is ~900 of this byte
    tokenizer's tokens: max_position_embeddings 4096 instead of 512 (plain RoPE; no other number changes)."""
    if not FIRST.exists():
        pytest.skip("tests/data/images is not in this copy of the tree")
    folder = tmp_path_factory.mktemp("minimax_m3_vl")
    for f in FIXTURE.iterdir():
        if f.is_file() and f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((FIXTURE / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 4096
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def image_server(start_server, vl_model, tmp_path_factory):
    local = tmp_path_factory.mktemp("local_media")
    (local / "first.png").write_bytes(FIRST.read_bytes())
    server = start_server("--api-key", API_KEY, "--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path",
                          str(local), "--enable-prompt-tokens-details", "--max-model-len", "2048", model=vl_model)
    return server, local


def test_an_image_chat_is_answered_as_generate_answers_its_ids_and_images(image_server, vl_model, sparrow_binary,
                                                                           tmp_path):
    server, _ = image_server
    response = post(server, chat_body(data_url(FIRST), data_url(SECOND)))
    assert response.status_code == 200, response.text[:500]
    body = response.json()
    ids = body["prompt_token_ids"]
    # Each image's one template placeholder became begin, 6 placeholders (a 2x3 grid of merged windows), end.
    runs = [i for i in range(len(ids)) if ids[i] == BEGIN]
    assert len(runs) == 2 and all(ids[r + 1:r + 8] == [IMAGE] * 6 + [END] for r in runs), ids
    assert ids.count(IMAGE) == 12
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"ids": ids, "images": [str(FIRST), str(SECOND)]}]}))
    run = subprocess.run([sparrow_binary, "generate", "--model", str(vl_model), "--prompt-ids", str(prompts),
                          "--max-tokens", "3", "--temperature", "0", "--ignore-eos"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["completions"][0] == body["choices"][0]["token_ids"]
    # The images matter: without them (the same text) the prompt is another one.
    text_only = post(server, {**chat_body(), "messages": [{"role": "user", "content": "Look: Which is brighter?"}]})
    assert text_only.status_code == 200 and text_only.json()["prompt_token_ids"].count(IMAGE) == 0


def test_a_repeated_image_hits_the_prefix_cache_and_another_image_does_not(image_server):
    server, _ = image_server
    first = post(server, chat_body(data_url(FIRST), text="Describe it."))
    again = post(server, chat_body(data_url(FIRST), text="Describe it."))
    other = post(server, chat_body(data_url(SECOND), text="Describe it."))
    for r in (first, again, other):
        assert r.status_code == 200, r.text[:500]
    ids = first.json()["prompt_token_ids"]
    image_at = ids.index(IMAGE)
    cached = lambda r: r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached(again) == (len(ids) - 1) // 64 * 64  # every full block before the last token
    assert cached(other) <= image_at  # none of the blocks with the other image's placeholders
    assert again.json()["choices"][0]["token_ids"] == first.json()["choices"][0]["token_ids"]
    # /metrics: the encoder cache answered the repeated image (vLLM's mm_cache counters) and the tower's time shows.
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    value = lambda name: float(next(l.split()[-1] for l in metrics.splitlines() if l.startswith(name + "{")))
    assert value("vllm:mm_cache_hits_total") >= 1
    assert value("vllm:mm_cache_queries_total") > value("vllm:mm_cache_hits_total")
    assert value("sparrow:encoder_seconds_total") > 0


def test_a_local_file_is_served_only_under_the_allowed_folder(image_server):
    server, local = image_server
    inside = post(server, chat_body(f"file://{local / 'first.png'}"))
    assert inside.status_code == 200, inside.text[:500]
    assert inside.json()["choices"][0]["token_ids"] == post(server, chat_body(data_url(FIRST))).json()["choices"][0]["token_ids"]
    outside = post(server, chat_body(f"file://{FIRST}"))
    assert outside.status_code == 400 and "allowed-local-media-path" in outside.json()["error"]["message"]
    escape = post(server, chat_body(f"file://{local}/../{local.name}/../../etc/passwd"))
    assert escape.status_code == 400


@pytest.mark.parametrize("url,words", [
    ("data:image/png;base64,@@@@", "bad base64"),
    ("data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(), "image"),
    ("data:image/png;base64," + base64.b64encode(FIRST.read_bytes()[:200]).decode() if FIRST.exists() else "", "png"),
    ("data:text/plain;base64,aGVsbG8=", "image/*"),
    ("data:image/png,rawbytes", "base64"),
    ("https://example.com/cat.png", "fetches no URLs"),
    ("file:///etc/passwd", "allowed-local-media-path"),
])
def test_bad_images_are_400s_naming_the_part(image_server, url, words):
    server, _ = image_server
    response = post(server, chat_body(url))
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert words.lower() in error["message"].lower(), error
    assert error["param"] == "messages[0].content[1].image_url.url", error
    assert post(server, chat_body(data_url(FIRST))).status_code == 200  # still serving


def test_limits_and_malformed_parts(image_server):
    server, _ = image_server
    too_many = post(server, chat_body(data_url(FIRST), data_url(SECOND), data_url(FIRST)))
    assert too_many.status_code == 400 and "at most 2 image" in too_many.json()["error"]["message"]
    no_url = post(server, {**chat_body(), "messages": [{"role": "user", "content": [{"type": "image_url",
                                                                                      "image_url": {}}]}]})
    assert no_url.status_code == 400 and "image_url.url" in no_url.json()["error"]["message"]
    audio = post(server, {**chat_body(), "messages": [{"role": "user", "content": [{"type": "input_audio",
                                                                                     "input_audio": {}}]}]})
    assert audio.status_code == 400 and "not supported" in audio.json()["error"]["message"]


def test_responses_input_images_are_answered_as_chat_answers_the_same_images(image_server):
    """/v1/responses' input_image parts (image_url: a data: or file:// URL) reach the model as chat's image_url parts
    do: the same prompt (input tokens) and the same greedy answer; a bad image is a 400 naming the part."""
    server, local = image_server
    chat = post(server, {**chat_body(data_url(FIRST), data_url(SECOND)), "max_tokens": 4})
    assert chat.status_code == 200, chat.text[:500]
    content = [{"type": "input_text", "text": "Look: "},
               {"type": "input_image", "image_url": data_url(FIRST), "detail": "auto"},
               {"type": "input_image", "image_url": data_url(SECOND)},
               {"type": "input_text", "text": "Which is brighter?"}]
    body = {"model": MODEL_NAME, "input": [{"role": "user", "content": content}], "max_output_tokens": 4,
            "temperature": 0}
    response = post(server, body, "/v1/responses")
    assert response.status_code == 200, response.text[:500]
    out = response.json()
    assert out["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    text = "".join(part["text"] for item in out["output"] if item["type"] == "message" for part in item["content"])
    assert text == chat.json()["choices"][0]["message"]["content"]
    # A local file under the allowed folder is the same image as its data: URL.
    content[1]["image_url"] = f"file://{local / 'first.png'}"
    local_file = post(server, body, "/v1/responses")
    assert local_file.status_code == 200 and local_file.json()["usage"] == out["usage"], local_file.text[:500]
    content[1]["image_url"] = "data:image/png;base64,@@@@"
    bad = post(server, body, "/v1/responses")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0].content[1].image_url", bad.text[:500]
    content[1] = {"type": "input_image", "file_id": "file-abc"}
    by_file = post(server, body, "/v1/responses")
    assert by_file.status_code == 400 and "Files API" in by_file.json()["error"]["message"]


def test_images_under_tensor_parallelism_get_the_single_process_answer(image_server, start_server, vl_model):
    """`--tensor-parallel-size 2` (real processes): rank 0 runs the tower and the step plan carries the image rows'
    embeddings to the worker (runner/step_plan.h); each image chat gets the single-process server's greedy tokens,
    a repeated image too (its prefix-cache hit and encoder-cache hit on rank 0)."""
    server, _ = image_server
    tp = start_server("--api-key", API_KEY, "--tensor-parallel-size", "2", "--limit-mm-per-prompt", '{"image": 2}',
                      "--max-model-len", "2048", model=vl_model)
    try:
        for urls in ([data_url(FIRST), data_url(SECOND)], [data_url(SECOND)], [data_url(SECOND)]):
            body = {**chat_body(*urls), "max_tokens": 5}
            want, got = post(server, body), post(tp, body)
            assert want.status_code == 200 and got.status_code == 200, got.text[:500]
            assert got.json()["prompt_token_ids"] == want.json()["prompt_token_ids"]
            assert got.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
    finally:
        tp.stop()


def test_a_text_only_model_refuses_images(server):
    response = post(server, chat_body("data:image/png;base64,AAAA"))
    assert response.status_code == 400 and "takes no images" in response.json()["error"]["message"]


def test_bad_image_flags_stop_the_start(sparrow_binary, vl_model):
    for flags, words in ([["--limit-mm-per-prompt", '{"video": 1}']], "images only"), \
                        ([["--limit-mm-per-prompt", "4"]], "must be JSON"), \
                        ([["--allowed-local-media-path", "/nonexistent/folder"]], "is not a folder"):
        run = subprocess.run([sparrow_binary, "serve", "--model", str(vl_model), "--port", "0", *flags[0]],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and words in run.stderr, (flags, run.stderr[-500:])


def test_bench_serve_random_mm_sends_images_the_server_answers(image_server, sparrow_binary):
    """`sparrow bench serve --dataset-name random-mm` (vLLM's random multimodal dataset) against the image server:
    every request, with its JPEG data URLs, is answered."""
    server, _ = image_server
    run = subprocess.run([sparrow_binary, "bench", "serve", "--base-url", server.url, "--dataset-name", "random-mm",
                          "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "2",
                          "--random-mm-base-items-per-request", "2", "--random-mm-bucket-config",
                          "{(56, 84, 1): 0.5, (112, 56, 1): 0.5}", "--disable-tqdm"],
                         capture_output=True, text=True, timeout=300, env={"OPENAI_API_KEY": API_KEY, "PATH": "/usr/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Successful requests:" in run.stdout and " 4" in run.stdout.split("Successful requests:")[1].split("\n")[0]
    assert "Failed requests:" not in run.stdout or " 0" in run.stdout.split("Failed requests:")[1].split("\n")[0]


# ---------------------------------------------------------------------------------------------------------------------
# Kimi K3 (tests/fixtures/kimi_k3_vl): the template writes <|kimi_image_placeholder|> per image part, which becomes
# "<|media_begin|>image {w}x{h}<|media_content|>", one <|media_pad|> per merged window and "<|media_end|>", the
# original size in the text (vLLM 0.33.0's models/kimi_k3/common/mm_preprocess.py).

KIMI_FIXTURE = REPO / "tests" / "fixtures" / "kimi_k3_vl"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, KIMI_IMAGE = 247, 248, 249, 250, 251


def byte_ids(text: str) -> list[int]:
    """The fixture tokenizer's ids of plain ASCII text (tools/make_vl_tokenizers.py: newline 0, then ' '..'~')."""
    return [0 if c == "\n" else ord(c) - 31 for c in text]


def test_kimi_k3_image_chats_are_expanded_and_answered_as_generate_answers_them(start_server, sparrow_binary, tmp_path):
    if not FIRST.exists():
        pytest.skip("tests/data/images is not in this copy of the tree")
    server = start_server("--api-key", API_KEY, "--limit-mm-per-prompt", '{"image": 2}', model=KIMI_FIXTURE)
    try:
        response = post(server, chat_body(data_url(FIRST), data_url(SECOND), ignore_eos=True))
        assert response.status_code == 200, response.text[:500]
        body = response.json()
        ids = body["prompt_token_ids"]
        assert KIMI_IMAGE not in ids and ids.count(MEDIA_PAD) == 12 + 20, ids
        for (w, h), pads in (((97, 61), 12), ((203, 151), 20)):
            run = [MEDIA_BEGIN] + byte_ids(f"image {w}x{h}") + [MEDIA_CONTENT] + [MEDIA_PAD] * pads + [MEDIA_END]
            assert any(ids[i:i + len(run)] == run for i in range(len(ids))), (w, h, ids)
        prompts = tmp_path / "prompts.json"
        prompts.write_text(json.dumps({"prompts": [{"ids": ids, "images": [str(FIRST), str(SECOND)]}]}))
        run = subprocess.run([sparrow_binary, "generate", "--model", str(KIMI_FIXTURE), "--prompt-ids", str(prompts),
                              "--max-tokens", "3", "--temperature", "0", "--ignore-eos"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["completions"][0] == body["choices"][0]["token_ids"]
        bad = post(server, chat_body(data_url(FIRST, "text/plain")))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content[1].image_url.url"
        assert post(server, chat_body(data_url(SECOND))).status_code == 200  # still serving
    finally:
        server.stop()
