"""sparrow's Python API, shaped after vLLM's offline `LLM` (docs/python.md).

    import sparrow
    llm = sparrow.LLM("models/minimax_m3")
    outputs = llm.generate(["def fibonacci(n):"], sparrow.SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text)

The engine is sparrow's own (the C++ extension sparrow._engine): the serving engine's scheduler, paged KV
cache with prefix caching and sampler, run to completion by each call. SamplingParams takes vLLM's field
names; each value is checked as `sparrow serve` checks the same field of a /v1/completions request.
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from . import _engine

__version__ = _engine.__version__

# vLLM's SamplingParams fields that sparrow carries out, with vLLM's defaults.
_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "stop": None,
    "stop_token_ids": None,
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "truncate_prompt_tokens": None,
    "structured_outputs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
}
# vLLM fields sparrow does not carry out: refused rather than silently ignored.
_UNSUPPORTED = {
    "best_of": "sparrow draws n independent choices and returns them all",
    "bad_words": "bad_words is not supported; use logit_bias",
    "logits_processors": "Python logits processors do not run inside sparrow's C++ engine",
    "detokenize": "outputs always carry their text",
    "output_kind": "generate() returns finished outputs",
    "spaces_between_special_tokens": "not supported",
    "guided_decoding": "use structured_outputs={'json': ..., 'regex': ..., 'choice': ..., 'grammar': ...}",
    "extra_args": "not supported",
}


class SamplingParams:
    """vLLM's SamplingParams fields (see _DEFAULTS). structured_outputs is a dict with one of json (a schema,
    dict or str), json_object, regex, choice or grammar, as vLLM's StructuredOutputsParams."""

    def __init__(self, **fields: Any):
        for name in fields:
            if name in _UNSUPPORTED:
                raise ValueError(f"SamplingParams.{name}: {_UNSUPPORTED[name]}")
            if name not in _DEFAULTS:
                raise TypeError(f"SamplingParams() got an unexpected keyword argument '{name}'")
        self._fields = {k: v for k, v in fields.items() if v is not None}
        _engine.Engine.check_params(self._json())

    def _json(self) -> str:
        return json.dumps(self._fields)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in _DEFAULTS:
            raise AttributeError(name)
        return self._fields.get(name, _DEFAULTS[name])

    def clone(self, **changes: Any) -> "SamplingParams":
        return SamplingParams(**{**self._fields, **changes})

    def __repr__(self) -> str:
        return "SamplingParams(" + ", ".join(f"{k}={v!r}" for k, v in self._fields.items()) + ")"


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


PromptType = Union[str, Sequence[int], dict]


@dataclass
class LoRARequest:
    """vLLM's LoRARequest: a PEFT adapter folder served under a name (docs/lora.md). lora_int_id is accepted for
    vLLM's sake; sparrow tells adapters apart by name."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def _pair(self) -> tuple[str, str]:
        return self.lora_name, str(self.lora_path)


class LLM:
    """A model and its engine. Arguments follow vLLM's LLM / engine arguments where sparrow has them."""

    def __init__(self, model: str, *, device: str = "cpu", load_format: str = "auto",
                 max_model_len: Optional[int] = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 kv_cache_memory_bytes: Optional[int] = None, gpu_memory_utilization: float = 0.9,
                 kv_cache_dtype: str = "auto", block_size: int = 64, enable_prefix_caching: bool = True,
                 enforce_eager: bool = False, seed: Optional[int] = None, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, decode_context_parallel_size: int = 1, tokenizer: Optional[str] = None,
                 trust_remote_code: bool = False, dtype: str = "auto", speculative_config: Optional[dict] = None,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: Optional[int] = None, batch_invariant: bool = False,
                 limit_mm_per_prompt: Optional[dict] = None, allowed_local_media_path: str = ""):
        if tensor_parallel_size != 1 or data_parallel_size != 1 or decode_context_parallel_size != 1:
            raise ValueError("the Python API runs one process: tensor_parallel_size, data_parallel_size and "
                             "decode_context_parallel_size must be 1 (for several GPUs serve with `sparrow serve -tp N` "
                             "and use its OpenAI API)")
        if tokenizer not in (None, model):
            raise ValueError("sparrow reads the tokenizer from the model folder")
        if dtype not in ("auto", "bfloat16"):
            raise ValueError("sparrow computes in bfloat16 on a GPU and float32 on the CPU: dtype must be 'auto'")
        self._engine = _engine.Engine(str(model), device, load_format, max_model_len or 0, max_num_seqs,
                                      max_num_batched_tokens, kv_cache_memory_bytes or 0, gpu_memory_utilization,
                                      kv_cache_dtype, block_size, enable_prefix_caching, enforce_eager, seed,
                                      json.dumps(speculative_config) if speculative_config else "", enable_lora,
                                      max_loras, max_lora_rank, batch_invariant,
                                      json.dumps(limit_mm_per_prompt) if limit_mm_per_prompt else "",
                                      str(allowed_local_media_path or ""))
        self.model = str(model)

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    def encode(self, text: str) -> list[int]:
        return self._engine.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._engine.decode(list(token_ids))

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """Prompts: a str, a list of token ids, {"prompt": str} or {"prompt_token_ids": [...]}, or a list of
        these. One SamplingParams for all, or one per prompt; likewise the LoRA adapter (None: the base model).
        A dict prompt may carry {"multi_modal_data": {"image": image or [images]}} (PIL images, file bytes or
        paths): its text or ids hold one image placeholder per image (docs/vision.md)."""
        listed, images = _prompts(prompts)
        return self._run(lambda p, s, l: self._engine.generate(p, s, l, images), listed, sampling_params,
                         lora_request)

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             tools: Optional[list[dict]] = None, chat_template_kwargs: Optional[dict] = None,
             use_tqdm: bool = False,
             lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered by the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        rendered = []
        for conversation in conversations:
            body: dict[str, Any] = {"messages": conversation}
            if tools is not None:
                body["tools"] = tools
            if chat_template_kwargs:
                body["chat_template_kwargs"] = chat_template_kwargs
            rendered.append(json.dumps(body))
        return self._run(self._engine.chat, rendered, sampling_params, lora_request)

    def load_lora(self, lora_request: LoRARequest) -> None:
        """Loads an adapter ahead of its first request (generate loads the ones it is given too)."""
        self._engine.load_lora(*lora_request._pair())

    def remove_lora(self, lora_name: str) -> None:
        self._engine.remove_lora(lora_name)

    def list_loras(self) -> list[str]:
        return self._engine.list_loras()

    def update_weights(self, model=None, *, weights=None) -> None:
        """Replaces the weights: with those of another folder of the same architecture (`model`), or with tensors
        from memory in place of the current folder's tensors of the same names (`weights`: a mapping or an
        iterable of (name, tensor) pairs, numpy arrays or torch tensors, as an RL trainer hands its policy over;
        a bfloat16 array held as numpy uint16 comes as (name, array, "BF16")). The engine's prefix cache is
        dropped; the next call generates with them."""
        if (model is None) == (weights is None):
            raise ValueError("update_weights takes a model folder or weights, one of them")
        if model is not None:
            self._engine.update_weights(str(model))
            return
        items = weights.items() if hasattr(weights, "items") else weights
        self._engine.update_weights_from_tensors([_host_tensor(*item) for item in items])

    def _run(self, call, prompts: list, sampling_params, lora_request=None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params]
        loras = [] if lora_request is None else lora_request if isinstance(lora_request, (list, tuple)) else [lora_request]
        results = call(prompts, [p._json() for p in params], [("", "") if r is None else r._pair() for r in loras])

        def decode(ids):  # a logprob's token text; none without a tokenizer
            try:
                return self._engine.decode(ids)
            except ValueError:
                return None
        return [_request_output(r, decode) for r in results]


_NUMPY_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64", "int32": "I32", "int64": "I64",
                 "uint8": "U8", "int8": "I8"}
_TORCH_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
                 "torch.float8_e4m3fn": "F8_E4M3", "torch.float8_e5m2": "F8_E5M2", "torch.uint8": "U8",
                 "torch.int8": "I8", "torch.int32": "I32", "torch.int64": "I64"}


def _host_tensor(name: str, tensor, dtype: Optional[str] = None):
    """(name, safetensors dtype, shape, contiguous bytes) of a numpy array or a torch tensor."""
    import numpy as np
    if type(tensor).__module__.startswith("torch"):
        import torch
        tensor = tensor.detach().to("cpu").contiguous()
        kind = dtype or _TORCH_DTYPES.get(str(tensor.dtype))
        if kind is None:
            raise ValueError(f"update_weights: {name!r} has dtype {tensor.dtype}, which sparrow does not take")
        shape = list(tensor.shape)
        data = tensor.reshape(-1).view(torch.uint8).numpy()
    else:
        array = np.ascontiguousarray(tensor)
        kind = dtype or _NUMPY_DTYPES.get(array.dtype.name)
        if kind is None:
            raise ValueError(f"update_weights: {name!r} has dtype {array.dtype}: give it as (name, array, dtype), "
                             f"dtype as safetensors spells it (\"BF16\" for bfloat16 held as uint16)")
        shape = list(array.shape)
        data = array.reshape(-1).view(np.uint8)
    return name, kind, shape, data


def _image_bytes(image) -> bytes:
    """An image of multi_modal_data as its file's bytes: bytes as given, a path read, a PIL image saved as PNG
    (lossless: the decoder gives back its RGB pixels)."""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        return Path(image).read_bytes()
    if hasattr(image, "save"):
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="PNG")
        return buffer.getvalue()
    raise TypeError(f"an image must be a PIL image, bytes or a path, not {type(image).__name__}")


def _prompts(prompts) -> tuple[list, list]:
    """The prompts (text or ids) and each one's images as bytes ([] when no prompt has any)."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts, (list, tuple)) and
                                            isinstance(prompts[0], int)):
        prompts = [prompts]
    out, images = [], []
    for p in prompts:
        mine = []
        if isinstance(p, dict):
            data = p.get("multi_modal_data") or {}
            if set(data) - {"image"}:
                raise ValueError(f"multi_modal_data: sparrow takes images only, not {sorted(set(data) - {'image'})}")
            given = data.get("image", [])
            mine = [_image_bytes(i) for i in (given if isinstance(given, (list, tuple)) else [given])]
            if "prompt_token_ids" in p:
                p = list(p["prompt_token_ids"])
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(p, str):
            p = [int(t) for t in p]
        out.append(p)
        images.append(mine)
    return out, images if any(images) else []


def _logprobs(entry: Optional[dict], decode) -> Optional[dict[int, Logprob]]:
    if entry is None:
        return None
    return {token: Logprob(logprob, rank, decode([token])) for token, (logprob, rank) in entry.items()}


def _request_output(r: dict, decode) -> RequestOutput:
    outputs = [CompletionOutput(o["index"], o["text"], o["token_ids"], o["cumulative_logprob"],
                                None if o["logprobs"] is None else [_logprobs(e, decode) for e in o["logprobs"]],
                                o["finish_reason"], o["stop_reason"]) for o in r["outputs"]]
    prompt_logprobs = None if r["prompt_logprobs"] is None else [_logprobs(e, decode) for e in r["prompt_logprobs"]]
    return RequestOutput(r["request_id"], r["prompt"] or None, r["prompt_token_ids"], prompt_logprobs, outputs,
                         True, r["num_cached_tokens"])


__all__ = ["LLM", "SamplingParams", "LoRARequest", "RequestOutput", "CompletionOutput", "Logprob"]
