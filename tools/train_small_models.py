#!/usr/bin/env python3
"""Trains one small model per family (a few million parameters, a few minutes on one GPU) together with
its tokenizer, so that sparrow can be tried end to end on models that really predict text: Python code,
and chats that think, call tools with the family's own syntax and answer from the tool's result.

    python3 tools/train_small_models.py --out models                      # all four, 2 min of training each
    python3 tools/train_small_models.py --out models --family kimi_k3 --minutes 6 --batch-size 32
    python3 tools/train_small_models.py --out models --family kimi_k3 --evaluate   # re-measure a saved model
    python3 tools/train_small_models.py --out /tmp/smoke --device cpu --minutes 0.2 --tiny   # smoke test

Per family, everything runs from files inside the repository (no network):
 1. Corpus. The Python standard library's source (sysconfig's "stdlib" path, tests excluded; every
    HELD_OUT_EVERY-th file is held out for perplexity) and thousands of synthetic conversations
    (tools/chat_corpus.py) rendered with the family's real chat template
    (tests/data/templates/<file>.jinja) by transformers' apply_chat_template, tools passed as JSON schemas.
 2. Tokenizer. A byte-level BPE trained with Hugging Face `tokenizers` on that text, configured like the
    family's real tokenizer.json (normalizer, pre-tokenizer regexes of tools/make_test_tokenizers.py), with
    every marker the chat template writes registered as a special added token (one id each). Digits
    stay single tokens (see train_tokenizer).
 3. Model. The transformers model class with a small config (Kimi K3, which transformers lacks:
    tools/kimi_k3_torch.py, the released architecture of tools/kimi_k3_reference.py, saved in the release
    layout and checked against that reference after training), trained with AdamW under bf16 autocast
    (CUDA) or fp32 (CPU), for --minutes (or --steps), on windows of the model's context, one third code,
    two thirds conversations. The loss covers every token:
    the templates' fixed text is cheap to learn, and it teaches the model what the turn boundaries
    look like from both sides; the user's random numbers are the only unpredictable part.
    Two things the transformers classes do not train are added, as the real models do it:
      * the sparse-attention indexers (DSA, MSA) get no gradient from the language-model loss (their
        top-k is not differentiable), so they are distilled from the main attention with a KL loss,
        dense for the first DENSE_WARMUP of training and on the selected keys afterwards (DeepSeek-V3.2's
        recipe); without it, the sparse layers would keep random keys beyond the budget. DSA indexers
        also keep a margin above the ReLU's zero (relu_floor_penalty), or many keys would tie at 0 and
        the selection would depend on the top-k implementation;
      * the MoE routers' e_score_correction_bias is moved after each step towards equal expert loads
        (DeepSeek-V3's auxiliary-loss-free balancing), so that no expert is left untrained.
 4. Output: <out>/<family>/ config.json, model.safetensors (bf16, routers' bias fp32; Kimi K3 as
    kimi_k3_reference.storage_dtype says), tokenizer.json,
    tokenizer_config.json (chat_template, bos, eos = end of turn, added_tokens_decoder),
    generation_config.json, README.md (the model card: size, data, steps, final loss, held-out
    perplexity measured by transformers (Kimi K3: kimi_k3_torch) on the reloaded files, sample generations).

Kimi models ship tokenizer.json (a Hugging Face BPE with Kimi's pre-tokenizer regex), not tiktoken.model,
so that transformers can load every folder without remote code.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.models.deepseek_v32 import modeling_deepseek_v32
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from chat_corpus import demo_conversation, make_conversations  # noqa: E402
from make_fixtures import (DEFAULT_MIN_GAP, Family, GapMonitor, build_model, compare_weights,  # noqa: E402
                           load_model, write_checkpoint)
from safetensors.torch import load_file, save_file  # noqa: E402
from make_test_tokenizers import DEEPSEEK_SPLITS, QWEN_SPLIT, added  # noqa: E402
import kimi_k3_torch  # noqa: E402
from tokenizer_reference import KIMI_PAT_STR  # noqa: E402

TEMPLATES = ROOT / "tests" / "data" / "templates"
HELD_OUT_EVERY = 20          # every 20th standard-library file (sorted by path) is held out
# Fraction of training with sparse selection off. The indexers learn from the dense attention then;
# afterwards only from the keys they selected, so what dense attention had found by then (the
# previous tokens an induction head needs, say) is all they will ever keep. Training from scratch,
# the attention needs a good part of the run to find its patterns.
DENSE_WARMUP = 0.4
DSA_FLOOR_MARGIN = 0.1       # see relu_floor_penalty
BIAS_UPDATE_RATE = 1e-3      # e_score_correction_bias step per update (DeepSeek-V3's gamma)
CHAT_FRACTION = 0.65         # share of training windows that are conversations


# ---------------------------------------------------------------------------------------------
# Families
# ---------------------------------------------------------------------------------------------

@dataclass
class Size:
    """The knobs that differ between the real run and the --tiny smoke test."""
    hidden: int
    head: int              # MLA nope / value head size (multiples of 8: grouped_mm wants 16-byte strides)
    latent: int            # MLA kv_lora_rank
    expert: int            # MoE expert (and shared expert) intermediate size
    dense: int             # intermediate size of the dense MLP (first layer)
    context: int           # training window = max_position_embeddings
    sparse_keys: int       # DSA index_topk; MSA index_block_size * index_topk_blocks
    vocab: int
    conversations: int
    code_megabytes: float
    batch: int
    eval_windows: int      # at most this many context windows per perplexity measurement
    sample_tokens: int     # longest sample generation


# About 3 M parameters (half of them in the embedding and output head): under 6 MB in bf16.
FULL = Size(hidden=192, head=32, latent=64, expert=32, dense=256, context=1024, sparse_keys=128, vocab=4096,
            conversations=6000, code_megabytes=16, batch=16, eval_windows=48, sample_tokens=120)
TINY = Size(hidden=64, head=16, latent=32, expert=16, dense=128, context=256, sparse_keys=32, vocab=1024,
            conversations=300, code_megabytes=1, batch=4, eval_windows=4, sample_tokens=24)


def deepseek_v32_config(size: Size, tiny: bool) -> dict:
    return dict(
        hidden_size=size.hidden, intermediate_size=size.dense, moe_intermediate_size=size.expert,
        num_hidden_layers=3 if tiny else 5, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=size.hidden // 2, kv_lora_rank=size.latent,
        qk_nope_head_dim=size.head, qk_rope_head_dim=16, v_head_dim=size.head,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True,
        index_topk=size.sparse_keys, index_n_heads=4, index_head_dim=32,
        max_position_embeddings=size.context, rms_norm_eps=1e-6,
        # YaRN as DeepSeek ships it (mscale = mscale_all_dim = 1), stretched 4x over the training context.
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": size.context // 4,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )


def kimi_linear_config(size: Size, tiny: bool) -> dict:
    # Kimi Linear interleaves KDA ("linear_attention") and MLA ("full_attention") layers 3:1; here
    # the MLA layers come third and last.
    layers = (["linear_attention", "full_attention", "linear_attention"] if tiny else
              ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"])
    return dict(
        hidden_size=size.hidden, intermediate_size=size.dense, moe_intermediate_size=size.expert,
        num_hidden_layers=len(layers), layer_types=layers,
        mlp_layer_types=["dense"] + ["sparse"] * (len(layers) - 1),
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=size.latent,
        qk_nope_head_dim=size.head, qk_rope_head_dim=16, v_head_dim=size.head,
        linear_num_heads=4, linear_head_dim=size.head, linear_conv_kernel_dim=4,
        num_local_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.446, norm_topk_prob=True, rms_norm_eps=1e-5,
        max_position_embeddings=size.context, tie_word_embeddings=False,
    )


def kimi_k3_config(size: Size, tiny: bool) -> dict:
    """The released Kimi K3 (tools/kimi_k3_reference.py, the fields of its TINY_TEXT_CONFIG): config.json
    is KimiK3Config {model_type kimi_k3, text_config: vLLM's KimiLinearConfig}. KDA and MLA layers as in
    kimi_linear_config (kda_layers / full_attn_layers 1-indexed), AttnRes over blocks of 2 layers, MLA
    with a q LoRA, no RoPE and a sigmoid output gate, SiTU MLPs, a dense first layer, then latent MoE.
    run_family adds vocab_size (text_config) and the token ids (text_config and top level)."""
    layers = 3 if tiny else 5
    kda = [1, 3] if tiny else [1, 2, 4]
    text = dict(
        model_type="kimi_linear",
        hidden_size=size.hidden, num_hidden_layers=layers, rms_norm_eps=1e-5,
        attn_res_block_size=2,
        linear_attn_config=dict(kda_layers=kda, full_attn_layers=[l for l in range(1, layers + 1) if l not in kda],
                                num_heads=4, head_dim=size.head, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                use_full_rank_gate=True),
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=size.hidden // 2, kv_lora_rank=size.latent,
        qk_nope_head_dim=size.head, qk_rope_head_dim=16, v_head_dim=size.head, mla_use_nope=True,
        mla_use_output_gate=True,
        hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
        intermediate_size=size.dense, first_k_dense_replace=1, moe_layer_freq=1,
        num_experts=8, num_experts_per_token=2, moe_intermediate_size=size.expert,
        routed_expert_hidden_size=size.hidden // 2, num_shared_experts=1, latent_moe_use_norm=True,
        routed_scaling_factor=2.5, moe_router_activation_func="sigmoid", moe_renormalize=True,
        use_grouped_topk=True, num_expert_group=1, topk_group=1, topk_method="noaux_tc",
        num_nextn_predict_layers=0, tie_word_embeddings=False, max_position_embeddings=size.context,
    )
    return dict(model_type="kimi_k3", architectures=["KimiK3ForConditionalGeneration"], text_config=text,
                tie_word_embeddings=False)


def minimax_m3_config(size: Size, tiny: bool) -> dict:
    block = 16 if tiny else 32
    layers = 3 if tiny else 5
    head_dim = 16 if tiny else 40  # 4 x 40 < hidden: keeps the file under 6 MB
    return dict(
        hidden_size=size.hidden, num_hidden_layers=layers,
        layer_types=["full_attention"] + ["minimax_m3_sparse"] * (layers - 1),
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rotary_dim=head_dim // 2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        intermediate_size=size.expert, dense_intermediate_size=size.dense,
        shared_intermediate_size=size.expert,
        num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0,
        # One indexer head per KV head, as MiniMax's kernel requires; the current block is always kept.
        index_n_heads=2, index_head_dim=32, index_block_size=block,
        index_topk_blocks=size.sparse_keys // block, index_local_blocks=1,
        max_position_embeddings=size.context, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )


@dataclass
class FamilySpec:
    template: str                  # file name in tests/data/templates
    tokenizer_style: str           # "deepseek", "minimax" or "kimi": normalizer, pre-tokenizer, file details
    leading_specials: list[str]    # special tokens at ids 0.. (before the BPE vocabulary)
    trailing_specials: list[str]   # special tokens after the BPE vocabulary
    bos: str
    end_of_turn: str               # eos: generation stops at the end of an assistant turn
    pad: str
    think_end: str                 # what closes the reasoning in an assistant turn
    config: Callable[[Size, bool], dict]
    # The template already opens the assistant turn after a user or tool message, and its
    # add_generation_prompt adds a second, empty user turn (the llama.cpp copy of DeepSeek-V3.2's
    # template), so prompts are rendered without it.
    add_generation_prompt: bool = True
    # Kimi K2 Thinking's template drops the reasoning of every assistant turn up to the last one
    # without tool calls, i.e. always that of a finished conversation; see render_training_text.
    drops_final_reasoning: bool = False
    architecture: str = ""


KIMI_SPECIALS = [  # Kimi-K2's named reserved tokens, K2 Thinking's media tokens and K3's markup tokens
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>",
    "[EOT]", "<|im_system|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_middle|>", "<think>", "</think>",
    "<|media_start|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
    "<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>", "<|kimi_image_placeholder|>", "[UNK]", "[PAD]",
]

FAMILIES = {
    "deepseek_v32": FamilySpec(
        template="deepseek-v3.2.jinja", tokenizer_style="deepseek",
        leading_specials=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"],
        trailing_specials=["<think>", "</think>", "<｜User｜>", "<｜Assistant｜>", "｜DSML｜",
                           "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                           "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                           "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"],
        bos="<｜begin▁of▁sentence｜>", end_of_turn="<｜end▁of▁sentence｜>", pad="<｜▁pad▁｜>", think_end="</think>",
        config=deepseek_v32_config, add_generation_prompt=False,
        architecture="DeepseekV32ForCausalLM: MLA + DeepSeek Sparse Attention (indexer top-k), MoE with a shared "
                     "expert and grouped sigmoid routing, YaRN rope"),
    "kimi_linear": FamilySpec(
        template="kimi-k2-thinking.jinja", tokenizer_style="kimi", leading_specials=[],
        trailing_specials=KIMI_SPECIALS, bos="[BOS]", end_of_turn="<|im_end|>", pad="[PAD]", think_end="</think>",
        config=kimi_linear_config, drops_final_reasoning=True,
        architecture="KimiLinearForCausalLM: Kimi Delta Attention layers interleaved with MLA (NoPE) layers, MoE "
                     "with a shared expert"),
    "kimi_k3": FamilySpec(
        template="kimi-k3.jinja", tokenizer_style="kimi", leading_specials=[],
        trailing_specials=KIMI_SPECIALS, bos="[BOS]", end_of_turn="<|end_of_msg|>", pad="[PAD]",
        think_end="<|close|>think<|sep|>",
        config=kimi_k3_config,
        architecture="Kimi K3 text model (KimiK3ForConditionalGeneration's language_model, the release's "
                     "architecture as vLLM 0.33 implements it; reference: tools/kimi_k3_reference.py, trained "
                     "with tools/kimi_k3_torch.py): Attention Residuals over blocks of layers instead of a "
                     "residual stream, Kimi Delta Attention (full-rank output gate, decay bounded by "
                     "gate_lower_bound) interleaved with MLA (q LoRA, no RoPE, sigmoid output gate), SiTU MLPs, "
                     "latent MoE (experts in a narrower latent space, sigmoid router with "
                     "e_score_correction_bias, a shared expert)"),
    "minimax_m3": FamilySpec(
        template="minimax-m3.jinja", tokenizer_style="minimax",
        leading_specials=["]!p~[", "]!d~[", "]~!b[", "]~b]", "[e~[", "]<]minimax[>[", "]<]image[>[", "]<]video[>["],
        trailing_specials=["<mm:think>", "</mm:think>"],
        bos="]~!b[", end_of_turn="[e~[", pad="]!p~[", think_end="</mm:think>",
        config=minimax_m3_config,
        architecture="MiniMaxM3VLForCausalLM (text model, model_type minimax_m3_vl_text): GQA with Gemma QK-norm and "
                     "partial rope, MiniMax Sparse Attention (block top-k) after the first layer, MoE with clamped "
                     "SwiGLU experts and a shared expert"),
}


# ---------------------------------------------------------------------------------------------
# Models: transformers' classes (tools/make_fixtures.py), or tools/kimi_k3_torch.py for Kimi K3
# ---------------------------------------------------------------------------------------------
# transformers has no Kimi K3: its family is trained as kimi_k3_torch.KimiK3ForConditionalGeneration,
# whose state_dict() names are the release checkpoint's, and checked against tools/kimi_k3_reference.py.

K3_MODULE_FAMILIES = {"kimi_k3"}
K3_REFERENCE_TOKENS = 40     # the reference check runs on the last 40 tokens of the tool-call chat prompt


def text_fields(config: dict) -> dict:
    """The text model's fields: config.json's text_config when it has one (K3), else the config itself."""
    return config.get("text_config", config)


def new_model(family: str, config: dict, seed: int):
    if family in K3_MODULE_FAMILIES:
        return kimi_k3_torch.KimiK3ForConditionalGeneration(config).init_weights(torch.Generator().manual_seed(seed))
    return build_model(family, config)


def reload_model(family: str, folder: Path):
    """The written folder, reloaded in float32; every tensor must find its parameter and vice versa."""
    if family in K3_MODULE_FAMILIES:
        config = json.loads((folder / "config.json").read_text())
        try:
            return kimi_k3_torch.from_weights(config, load_file(folder / "model.safetensors"), torch.float32)
        except ValueError as error:
            raise SystemExit(f"reloading {folder}: {error}")
    return load_model(family, folder)


def save_model(family: str, model, config: dict, folder: Path) -> dict:
    """Writes model.safetensors and config.json; returns the fp32 weights a reload must give."""
    if family not in K3_MODULE_FAMILIES:
        return write_checkpoint(family, Family({}, "bfloat16"), model, folder, folder / ".scratch")
    # The release layout: bf16, with float32 where vLLM keeps float32 (A_log, dt_bias, conv taps,
    # e_score_correction_bias: kimi_k3_reference.storage_dtype). The module takes the stored values, so
    # that what is evaluated afterwards is what was written.
    reference = kimi_k3_torch.load_reference()
    tensors = {n: t.detach().cpu().to(reference.storage_dtype(n)).contiguous() for n, t in model.state_dict().items()}
    model.load_state_dict({n: t.float() for n, t in tensors.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {n: t.float() for n, t in tensors.items()}


def model_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """logits [B, T, vocab] of token ids [B, T], each row processed from position 0 without a cache."""
    if isinstance(model, kimi_k3_torch.KimiK3ForConditionalGeneration):
        return model(ids)
    return model(input_ids=ids, use_cache=False).logits


def reference_agreement(folder: Path, model, tokens: list[int], device: torch.device) -> dict:
    """tools/kimi_k3_reference.forward (float64, on the stored weights of the folder) against the module's
    float32 logits on `tokens`: max |difference| / max |reference logit|."""
    reference = kimi_k3_torch.load_reference()
    config = json.loads((folder / "config.json").read_text())
    with torch.no_grad():
        want = reference.forward(config, load_file(folder / "model.safetensors"), tokens)
        got = model_logits(model, torch.tensor([tokens], device=device))[0].double().cpu()
    return {"tokens": len(tokens), "relative_error": kimi_k3_torch.relative_error(got, want),
            "max_abs_error": float((got - want).abs().max()), "max_abs_logit": float(want.abs().max()),
            "same_argmax": bool((got.argmax(-1) == want.argmax(-1)).all()), "device": device_name(device)}


# ---------------------------------------------------------------------------------------------
# Text: the standard library and the rendered conversations
# ---------------------------------------------------------------------------------------------

def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's .py files, sorted, without test suites, installed packages, and the
    generated tables of encodings/ and pydoc_data/ (which would teach mostly hex columns)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
               "encodings", "pydoc_data"}
    files = sorted(p for p in root.rglob("*.py") if not skipped & set(p.relative_to(root).parts[:-1]))
    if not files:
        raise SystemExit(f"no Python source under {root} (sysconfig's stdlib path)")
    return root, files


def read_code(files: list[Path], megabytes: float, seed: int) -> list[str]:
    """Whole files in a seeded order until `megabytes` of text."""
    order = list(files)
    random.Random(seed).shuffle(order)
    texts, total = [], 0
    for path in order:
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text.encode())
        if total >= megabytes * 1e6:
            break
    return texts


def read_template(templates: Path, spec: FamilySpec) -> str:
    path = templates / spec.template
    if not path.is_file():
        raise SystemExit(f"chat template {path} is missing: the copies of the real templates belong in "
                         f"{TEMPLATES.relative_to(ROOT)}/ (or pass --templates DIR)")
    return path.read_text(encoding="utf-8")


def chat_tokenizer(tokenizer: Tokenizer, spec: FamilySpec, template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=spec.bos, eos_token=spec.end_of_turn,
                                   pad_token=spec.pad, chat_template=template)


def render_prompt(chat: PreTrainedTokenizerFast, spec: FamilySpec, messages: list[dict], tools: list[dict]) -> str:
    """What the model is given to write the next assistant turn."""
    return chat.apply_chat_template(messages, tools=tools, tokenize=False,
                                    add_generation_prompt=spec.add_generation_prompt)


def render_training_text(chat: PreTrainedTokenizerFast, spec: FamilySpec, messages: list[dict],
                         tools: list[dict]) -> str:
    """The conversation as the model sees it while writing its last turn.

    For most templates that is simply the rendered conversation. Kimi K2 Thinking's template keeps
    reasoning_content only after the last assistant turn without tool calls, so a finished
    conversation comes out with every <think></think> empty; the model, though, writes its
    reasoning. Its text is therefore the template's prompt for the last turn (which keeps the
    reasoning of the turn's tool calls) followed by the last turn with its reasoning, written as the
    template writes turns it keeps: <think>{reasoning}</think>{content}<|im_end|>."""
    text = chat.apply_chat_template(messages, tools=tools, tokenize=False)
    if not spec.drops_final_reasoning:
        return text
    final = messages[-1]
    finished = f"<think></think>{final['content']}{spec.end_of_turn}"
    if final["role"] != "assistant" or not text.endswith(finished):
        raise SystemExit(f"{spec.template}: a finished conversation no longer ends with {finished!r}")
    prompt = render_prompt(chat, spec, messages[:-1], tools)
    return prompt + f"<think>{final['reasoning_content']}</think>{final['content']}{spec.end_of_turn}"


def check_prompts_match_training(chat, spec: FamilySpec):
    """The prompts used at generation time must be prefixes of the training text, or the model would
    be asked something it never saw."""
    messages, tools = demo_conversation()
    text = render_training_text(chat, spec, messages, tools)
    for end in (1, 3):  # before the tool call, and after the tool's result
        prompt = render_prompt(chat, spec, messages[:end], tools)
        if not text.startswith(prompt):
            raise SystemExit(f"{spec.template}: the prompt for message {end} is not a prefix of the training text:\n"
                             f"{prompt!r}\nvs\n{text[:len(prompt) + 40]!r}")


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def empty_tokenizer(spec: FamilySpec) -> Tokenizer:
    """A BPE without merges, with the family's normalizer, pre-tokenizer and decoder."""
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if spec.tokenizer_style == "deepseek":  # DeepSeek-V3's three isolated splits
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in DEEPSEEK_SPLITS]
        tokenizer.normalizer = normalizers.Sequence([])
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(splits + [byte_level])
    elif spec.tokenizer_style == "minimax":  # NFC, then the Qwen2-style split
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False), byte_level])
    else:  # Kimi's tiktoken pat_str
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated", invert=False), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(spec: FamilySpec, texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE of `vocab_size` tokens in all: the leading specials, the 256 bytes, the merges,
    then the trailing specials."""
    tokenizer = empty_tokenizer(spec)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(spec.trailing_specials), min_frequency=2,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[added(t, True) for t in spec.leading_specials])
    # The trainer does not split out added tokens, so markers are cut out of the text it sees. Digits
    # are cut out too, so that no multi-digit token is learned: every pre-tokenizer here isolates
    # digit runs, so numbers become one token per digit, and a model this small learns to copy
    # numbers (from the question into the tool call, from the tool result into the answer) from ten
    # tokens much sooner than from hundreds.
    cut = re.compile("|".join([re.escape(t) for t in spec.leading_specials + spec.trailing_specials] + [r"\d+"]))
    tokenizer.train_from_iterator((piece for text in texts for piece in cut.split(text) if piece), trainer)
    tokenizer.add_special_tokens([added(t, True) for t in spec.trailing_specials])
    return tokenizer


def tokenizer_json(spec: FamilySpec, tokenizer: Tokenizer) -> dict:
    """tokenizer.json with the family's file details (what `tokenizers` would write differently)."""
    data = json.loads(tokenizer.to_str())
    if spec.tokenizer_style == "deepseek":
        # DeepSeek's files: merges as "a b" strings; the post-processor puts BOS first when asked to add
        # special tokens (chat templates write BOS themselves and are encoded without).
        data["model"]["merges"] = [f"{a} {b}" for a, b in data["model"]["merges"]]
        bos = spec.bos
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tokenizer.token_to_id(bos)], "tokens": [bos]}},
        }
    elif spec.tokenizer_style == "minimax":
        data["pre_tokenizer"]["pretokenizers"][1]["trim_offsets"] = False
        data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                                  "use_regex": False}
    return data


def write_tokenizer(folder: Path, spec: FamilySpec, tokenizer: Tokenizer, template: str, context: int):
    data = tokenizer_json(spec, tokenizer)
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos, "eos_token": spec.end_of_turn, "pad_token": spec.pad, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": context,
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                 for t in data["added_tokens"]},
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n",
                                                  encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Sparse indexers: distilled from the main attention
# ---------------------------------------------------------------------------------------------

def dsa_index_scores(indexer, hidden_states, q_resid, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepseekV32Indexer.forward (transformers 5.17) up to its top-k, with gradients: the index scores
    [B, S, T] and the per-head logits before the ReLU [B, S, H, T]."""
    batch, length, _ = hidden_states.shape
    rope, rest = indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(batch, length, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    (q_rot, q_pass), (k_rot, k_pass) = q.split([rope, rest], -1), k.split([rope, rest], -1)
    cos, sin = position_embeddings
    q_rot, k_rot = modeling_deepseek_v32.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1).squeeze(2)
    logits = (q.float() @ k.float().transpose(-1, -2).unsqueeze(1)) * indexer.softmax_scale  # [B, S, H, T]
    weights = indexer.weights_proj(hidden_states).float() * indexer.n_heads ** -0.5
    return (weights.unsqueeze(-2) @ F.relu(logits)).squeeze(-2), logits


def relu_floor_penalty(logits: torch.Tensor) -> torch.Tensor:
    """Keeps, for every causal (query, key) pair, at least one DSA head's logit DSA_FLOOR_MARGIN above 0.

    A key whose logits are all <= 0 scores exactly 0 after the ReLU, and the distillation pushes
    unimportant keys there, so many keys would tie at 0 on the top-k boundary: which of them is kept
    would then depend on the top-k implementation, and sparrow could not be compared with
    transformers. With one positive term the score is a weighted sum that is almost never tied."""
    batch, length, _, keys = logits.shape
    causal = torch.ones(length, keys, device=logits.device).tril()
    shortfall = F.relu(DSA_FLOOR_MARGIN - logits.amax(dim=2)) * causal  # [B, S, T]
    # Summed over the keys of a query (not averaged over all pairs), so that the few pairs still
    # below the margin late in training are not drowned by the KL.
    return shortfall.sum() / (batch * length)


def msa_index_scores(indexer, hidden_states, position_embeddings) -> torch.Tensor:
    """MiniMaxM3VLIndexer.forward (transformers 5.17) before its block pooling, with gradients:
    per-token scores [B, index heads, S, T]."""
    batch, length, _ = hidden_states.shape
    q = indexer.q_norm(indexer.q_proj(hidden_states).view(batch, length, -1, indexer.head_dim)).transpose(1, 2)
    k = indexer.k_norm(indexer.k_proj(hidden_states).view(batch, length, 1, indexer.head_dim)).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = modeling_minimax_m3_vl.apply_rotary_pos_emb(q, k, cos[..., :indexer.head_dim], sin[..., :indexer.head_dim])
    return q.float() @ k.float().transpose(-1, -2)


def distillation_kl(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over query rows of KL(target || softmax(scores)) on the keys the attention used (target > 0:
    the causal keys while dense, the selected ones while sparse)."""
    used = target > 0
    log_q = torch.log_softmax(scores.masked_fill(~used, float("-inf")), dim=-1).masked_fill(~used, 0.0)
    kl = (target * (target.clamp_min(1e-30).log() - log_q)).sum(-1)
    return kl.mean()


class IndexerDistillation:
    """Trains every DSA / MSA indexer towards its layer's attention distribution (DeepSeek-V3.2's
    indexer warm-up and sparse stage). The indexer's inputs are detached, so this loss trains only the
    indexer and the language-model loss never reaches it; the main attention is the target only.

    Hooks: the indexer's forward-pre hook keeps its inputs; the attention's forward hook receives the
    attention probabilities (eager attention returns them) and adds that layer's KL to `losses` (and,
    for DSA, its relu_floor_penalty to `penalties`)."""

    def __init__(self, model):
        self.losses: list[torch.Tensor] = []     # per sparse layer: KL
        self.penalties: list[torch.Tensor] = []  # per DSA layer: relu_floor_penalty
        self.layers = []   # (attention module, kind, original budget)
        self.handles = []
        for module in model.modules():
            indexer = getattr(module, "indexer", None)
            if isinstance(indexer, modeling_deepseek_v32.DeepseekV32Indexer):
                self.layers.append((module, "dsa", indexer.index_topk))
            elif isinstance(indexer, modeling_minimax_m3_vl.MiniMaxM3VLIndexer):
                self.layers.append((module, "msa", indexer.topk_blocks))
        for attention, kind, _ in self.layers:
            self.handles.append(attention.indexer.register_forward_pre_hook(self.keep_inputs, with_kwargs=True))
            self.handles.append(attention.register_forward_hook(self.add_loss))

    def keep_inputs(self, indexer, args, kwargs):
        indexer.distillation_inputs = args

    def add_loss(self, attention, args, output):
        if not (attention.training and torch.is_grad_enabled()):
            return
        probabilities = output[1].detach().float()  # [B, heads, S, T]
        inputs = attention.indexer.distillation_inputs
        if isinstance(attention.indexer, modeling_deepseek_v32.DeepseekV32Indexer):
            hidden, q_resid, position_embeddings = inputs[0], inputs[1], inputs[2]
            scores, logits = dsa_index_scores(attention.indexer, hidden.detach(), q_resid.detach(),
                                              tuple(t.detach() for t in position_embeddings))
            target = probabilities.mean(1)  # one selection for all heads
            self.penalties.append(relu_floor_penalty(logits))
        else:
            hidden, position_embeddings = inputs[0], inputs[1]
            scores = msa_index_scores(attention.indexer, hidden.detach(),
                                      tuple(t.detach() for t in position_embeddings))
            groups = scores.shape[1]  # one selection per KV head, for the query heads of its group
            batch, heads, length, keys = probabilities.shape
            target = probabilities.view(batch, groups, heads // groups, length, keys).mean(2)
        self.losses.append(distillation_kl(scores, target))
        attention.indexer.distillation_inputs = None

    def set_dense(self, dense: bool):
        """Dense: every causal key selected (the indexer's budget raised above the context)."""
        for attention, kind, budget in self.layers:
            if kind == "dsa":
                attention.indexer.index_topk = 1 << 30 if dense else budget
            else:
                attention.indexer.topk_blocks = 1 << 30 if dense else budget

    def take_loss(self) -> tuple[torch.Tensor, float] | None:
        """(the indexers' loss for this step, its mean KL part), or None without sparse layers."""
        losses, penalties, self.losses, self.penalties = self.losses, self.penalties, [], []
        if not losses:
            return None
        kl = torch.stack(losses).mean()
        loss = kl + torch.stack(penalties).mean() if penalties else kl
        return loss, kl.item()

    def remove(self):
        self.set_dense(False)
        for handle in self.handles:
            handle.remove()


class RouterBalancer:
    """Auxiliary-loss-free load balancing (DeepSeek-V3 §2.1.2): after each step, every router's
    e_score_correction_bias moves by `rate` up for experts that got fewer tokens than the mean and
    down for those that got more. It only shifts which experts are chosen, not their weights."""

    def __init__(self, model, rate: float):
        self.rate = rate
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.counts = {id(r): None for r in self.routers}
        self.handles = [r.register_forward_hook(self.count) for r in self.routers]

    def count(self, router, args, output):
        if router.training:
            # every router returns (logits, weights, expert indices), kimi_k3_torch.MoEGate too
            chosen = output[-1].reshape(-1)
            counts = torch.bincount(chosen, minlength=router.e_score_correction_bias.numel())
            previous = self.counts[id(router)]
            self.counts[id(router)] = counts if previous is None else previous + counts

    @torch.no_grad()
    def update(self) -> float:
        """Applies the bias step; returns the largest expert load relative to the mean in this step."""
        worst = 0.0
        for router in self.routers:
            counts = self.counts[id(router)]
            if counts is None:
                continue
            load = counts.float()
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            worst = max(worst, float(load.max() / load.mean().clamp_min(1)))
            self.counts[id(router)] = None
        return worst

    def remove(self):
        for handle in self.handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

@dataclass
class Corpus:
    code: torch.Tensor            # all training files' tokens, one stream
    chats: torch.Tensor           # all training conversations' tokens, one stream
    chat_starts: torch.Tensor     # where each conversation starts in `chats` (windows start there)


def sample_batch(corpus: Corpus, batch: int, context: int, generator: torch.Generator) -> torch.Tensor:
    """`batch` windows of `context` tokens: CHAT_FRACTION of them start at a conversation's first
    token, the others anywhere in the code."""
    chat_rows = int(torch.binomial(torch.tensor(float(batch)), torch.tensor(CHAT_FRACTION), generator=generator))
    starts_ok = corpus.chat_starts[corpus.chat_starts + context <= corpus.chats.numel()]
    chat_starts = starts_ok[torch.randint(len(starts_ok), (chat_rows,), generator=generator)]
    code_starts = torch.randint(corpus.code.numel() - context, (batch - chat_rows,), generator=generator)
    offsets = torch.arange(context)
    rows = [corpus.chats[chat_starts[:, None] + offsets], corpus.code[code_starts[:, None] + offsets]]
    return torch.cat(rows)


def learning_rate(progress: float, peak: float) -> float:
    """Linear warm-up over the first 3%, cosine down to 10% of the peak at the end."""
    if progress < 0.03:
        return peak * max(progress / 0.03, 0.02)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (progress - 0.03) / 0.97))))


@dataclass
class TrainingLog:
    batch: int = 0
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    first_loss: float = float("nan")
    final_loss: float = float("nan")
    final_indexer_kl: float | None = None
    expert_load_peak: float | None = None
    history: list[tuple[int, float]] = field(default_factory=list)


def train(model, corpus: Corpus, args, size: Size, device: torch.device) -> TrainingLog:
    model.to(device).train()
    indexers = IndexerDistillation(model)
    balancer = RouterBalancer(model, BIAS_UPDATE_RATE)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    generator = torch.Generator().manual_seed(args.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    log = TrainingLog(batch=args.batch_size or size.batch)
    budget = args.minutes * 60.0
    start = last_print = time.time()
    losses, kls, printed = [], [], 0   # per step; `printed` = steps already in a progress line
    while True:
        progress = log.steps / args.steps if args.steps else (time.time() - start) / budget
        if progress >= 1.0:
            break
        dense = progress < DENSE_WARMUP
        indexers.set_dense(dense)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(progress, args.lr)

        batch = sample_batch(corpus, log.batch, size.context, generator).to(device)
        with autocast:
            logits = model_logits(model, batch)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        indexer = indexers.take_loss()
        total = loss if indexer is None else loss + indexer[0]
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        load_peak = balancer.update()

        log.steps += 1
        log.tokens += batch.numel()
        losses.append(loss.item())
        if indexer is not None:
            kls.append(indexer[1])
        now = time.time()
        if now - last_print >= args.print_every or log.steps == 1:
            mean = sum(losses[printed:]) / (log.steps - printed)
            log.history.append((log.steps, mean))
            kl = f"  indexer KL {sum(kls[-20:]) / len(kls[-20:]):.3f}" if kls else ""
            phase = ("dense  " if dense else "sparse  ") if indexers.layers else ""
            print(f"    step {log.steps:5d}  {now - start:6.1f}s  loss {mean:.3f}{kl}  "
                  f"lr {optimizer.param_groups[0]['lr']:.2e}  {phase}"
                  f"expert load max/mean {load_peak:.2f}  {log.tokens / (now - start):,.0f} tok/s", flush=True)
            last_print, printed = now, log.steps
    if not losses:
        raise SystemExit("no training step ran: raise --minutes or --steps")
    log.first_loss = losses[0]
    log.final_loss = sum(losses[-20:]) / len(losses[-20:])
    log.final_indexer_kl = sum(kls[-20:]) / len(kls[-20:]) if kls else None
    log.expert_load_peak = load_peak if balancer.routers else None
    log.seconds = time.time() - start
    if log.history[-1][0] != log.steps:
        log.history.append((log.steps, sum(losses[printed:]) / (log.steps - printed)))
    indexers.remove()
    balancer.remove()
    model.eval()
    return log


# ---------------------------------------------------------------------------------------------
# Evaluation on the saved files
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def perplexity(model, tokenizer, ids: list[int], size: Size, device: torch.device) -> dict:
    """Mean next-token loss over up to size.eval_windows non-overlapping windows of `context` tokens (the
    first token of each window is not predicted), as perplexity and as bits per byte of text."""
    context = size.context
    windows = min(size.eval_windows, len(ids) // context)
    if windows == 0:
        raise SystemExit(f"held-out text has {len(ids)} tokens, fewer than one window of {context}")
    data = torch.tensor(ids[:windows * context]).view(windows, context)
    total, count, text_bytes = 0.0, 0, 0
    for batch in data.split(8):
        logits = model_logits(model, batch.to(device)).float()
        total += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1).to(device),
                                 reduction="sum").item()
        count += batch[:, 1:].numel()
        text_bytes += sum(len(tokenizer.decode(row[1:].tolist()).encode()) for row in batch)
    return {"perplexity": math.exp(total / count), "bits_per_byte": total / math.log(2) / text_bytes,
            "tokens": count, "windows": windows}


@torch.no_grad()
def topk_gaps(model, sequences: list[list[int]], device: torch.device) -> dict[str, float]:
    """The smallest relative gap between the k-th and (k+1)-th value of every top-k the model takes
    (indexer keys or blocks, experts; make_fixtures.GapMonitor) over one forward per sequence. A gap
    near 0 means that some selection is decided by rounding, so that another implementation may
    select differently there."""
    monitor = GapMonitor()
    with monitor:
        for ids in sequences:
            model_logits(model, torch.tensor([ids], device=device))
    return {site: gap for site, (gap, _) in sorted(monitor.smallest.items())}


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int, device: torch.device, stop_id: int | None) -> str:
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
    if isinstance(model, kimi_k3_torch.KimiK3ForConditionalGeneration):
        return tokenizer.decode(model.generate_greedy(ids[0].tolist(), max_new_tokens, stop_id), skip_special_tokens=False)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=stop_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=False)


def held_out_texts(args, spec: FamilySpec, size: Size) -> tuple[list[str], list[str], str]:
    """The held-out standard-library files, held-out conversations (another seed) and a description."""
    root, files = stdlib_files()
    held = files[::HELD_OUT_EVERY]
    code = [p.read_text(encoding="utf-8", errors="replace") for p in held]
    template = read_template(args.templates, spec)
    chat = chat_tokenizer(empty_tokenizer(spec), spec, template)
    conversations = make_conversations(args.seed + 1000, max(50, size.conversations // 20))
    chats = [render_training_text(chat, spec, m, t) for m, t in conversations]
    where = (f"{len(held)} files (every {HELD_OUT_EVERY}th of the {len(files)} .py files of {root}, sorted by path, "
             f"tests excluded; Python {sys.version.split()[0]})")
    return code, chats, where


def evaluate(folder: Path, family: str, args, size: Size, device: torch.device) -> dict:
    """Reloads the written folder (with transformers; Kimi K3 with tools/kimi_k3_torch.py) and measures it:
    perplexity on held-out code and conversations, the model card's sample generations, and for Kimi K3
    the agreement with tools/kimi_k3_reference.py."""
    spec = FAMILIES[family]
    model = reload_model(family, folder).to(device)  # every tensor must load into its parameter
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template is None:
        raise SystemExit(f"{folder}: transformers found no chat_template in tokenizer_config.json")
    code, chats, where = held_out_texts(args, spec, size)
    code_ids = [i for text in code for i in tokenizer(text + "\n\n", add_special_tokens=False).input_ids]
    chat_ids = [i for text in chats for i in tokenizer(text, add_special_tokens=False).input_ids]
    result = {"code": perplexity(model, tokenizer, code_ids, size, device),
              "chat": perplexity(model, tokenizer, chat_ids, size, device), "held_out": where}

    context = size.context
    windows = [code_ids[i * context:(i + 1) * context] for i in range(2)] + \
              [chat_ids[i * context:(i + 1) * context] for i in range(2)]
    end_of_turn = tokenizer.convert_tokens_to_ids(spec.end_of_turn)
    messages, tools = demo_conversation()
    call_prompt = tokenizer.apply_chat_template(messages[:1], tools=tools, tokenize=False,
                                                add_generation_prompt=spec.add_generation_prompt)
    answer_prompt = tokenizer.apply_chat_template(messages[:3], tools=tools, tokenize=False,
                                                  add_generation_prompt=spec.add_generation_prompt)
    call_text = generate(model, tokenizer, call_prompt, size.sample_tokens, device, end_of_turn)
    call = call_text.split(spec.think_end)[-1]  # the part after the reasoning
    answer_text = generate(model, tokenizer, answer_prompt, size.sample_tokens, device, end_of_turn)
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in (call_prompt, answer_prompt)]
    result["topk_gaps"] = topk_gaps(model, prompts + [w for w in windows if len(w) == context], device)
    if family in K3_MODULE_FAMILIES:
        result["reference"] = reference_agreement(folder, model, prompts[0][-K3_REFERENCE_TOKENS:], device)
    result["samples"] = {
        "code_prompt": "def fibonacci(n):", "tokens": size.sample_tokens,
        "code": generate(model, tokenizer, "def fibonacci(n):", size.sample_tokens, device, None),
        "call_prompt_tail": call_prompt[-160:], "call": call_text,
        "call_ok": "calculator" in call and "48 * 17" in call,
        "answer_prompt_tail": answer_prompt[-160:], "answer": answer_text, "answer_ok": "816" in answer_text,
    }
    return result


# ---------------------------------------------------------------------------------------------
# One family, end to end
# ---------------------------------------------------------------------------------------------

def training_texts(spec: FamilySpec, templates: Path, seed: int, code_megabytes: float,
                   conversations: int) -> tuple[list[str], list[str]]:
    """The training sources: standard-library files (the held-out ones excluded) and rendered conversations."""
    _, files = stdlib_files()
    held = set(files[::HELD_OUT_EVERY])
    code = read_code([p for p in files if p not in held], code_megabytes, seed)
    renderer = chat_tokenizer(empty_tokenizer(spec), spec, read_template(templates, spec))
    check_prompts_match_training(renderer, spec)
    chats = [render_training_text(renderer, spec, m, t) for m, t in make_conversations(seed, conversations)]
    return code, chats


def encode_corpus(tokenizer: Tokenizer, code: list[str], chats: list[str]) -> tuple[Corpus, list[list[int]]]:
    """The texts as token streams (code files joined by blank lines, conversations with their starts), and
    each conversation's ids."""
    def encode(texts):
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    code_ids = [i for ids in encode([t + "\n\n" for t in code]) for i in ids]
    chat_ids = encode(chats)
    starts = torch.tensor([0] + [len(ids) for ids in chat_ids]).cumsum(0)[:-1]
    return Corpus(torch.tensor(code_ids), torch.tensor([i for ids in chat_ids for i in ids]), starts), chat_ids


def build_corpus(spec: FamilySpec, args, size: Size) -> tuple[Tokenizer, Corpus, dict]:
    t0 = time.time()
    code, chats = training_texts(spec, args.templates, args.seed, size.code_megabytes, size.conversations)
    print(f"  corpus: {len(code)} code files ({sum(map(len, code)) / 1e6:.1f} M chars), {len(chats)} conversations "
          f"({sum(map(len, chats)) / 1e6:.1f} M chars), {time.time() - t0:.1f}s", flush=True)

    t0 = time.time()
    tokenizer = train_tokenizer(spec, code + chats, size.vocab)
    print(f"  tokenizer: {tokenizer.get_vocab_size()} tokens, {time.time() - t0:.1f}s", flush=True)

    corpus, chat_ids = encode_corpus(tokenizer, code, chats)
    lengths = sorted(len(ids) for ids in chat_ids)
    stats = {"code_files": len(code), "code_tokens": int(corpus.code.numel()), "conversations": len(chats),
             "chat_tokens": int(corpus.chats.numel()), "chat_length_median": lengths[len(lengths) // 2],
             "chat_length_max": lengths[-1], "template": spec.template}
    print(f"  tokens: code {stats['code_tokens']:,}, chats {stats['chat_tokens']:,} (median conversation "
          f"{stats['chat_length_median']}, longest {stats['chat_length_max']})", flush=True)
    return tokenizer, corpus, stats


def run_family(family: str, args, size: Size, device: torch.device):
    spec = FAMILIES[family]
    folder = args.out / family
    print(f"== {family}", flush=True)
    if args.evaluate:
        report = evaluate(folder, family, args, size, device)
        print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
        print(json.dumps(report["samples"], indent=2, ensure_ascii=False))
        return

    torch.manual_seed(args.seed)
    tokenizer, corpus, stats = build_corpus(spec, args, size)
    ids = {name: tokenizer.token_to_id(name) for name in (spec.bos, spec.end_of_turn, spec.pad)}
    token_ids = dict(bos_token_id=ids[spec.bos], eos_token_id=ids[spec.end_of_turn], pad_token_id=ids[spec.pad])
    config = spec.config(size, args.tiny)
    if "text_config" in config:   # K3: the text fields nested, the token ids at both levels
        config = dict(config, text_config=dict(config["text_config"], vocab_size=tokenizer.get_vocab_size(),
                                               **token_ids), **token_ids)
    else:
        config = dict(config, vocab_size=tokenizer.get_vocab_size(), **token_ids)
    model = new_model(family, config, args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"  model: {parameters / 1e6:.2f} M parameters", flush=True)
    log = train(model, corpus, args, size, device)
    memory = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
    print(f"  trained {log.steps} steps, {log.tokens / 1e6:.1f} M tokens in {log.seconds:.0f}s: "
          f"loss {log.first_loss:.3f} -> {log.final_loss:.3f}{memory}", flush=True)

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    model.to("cpu")
    expected = save_model(family, model, config, folder)
    template = read_template(args.templates, spec)
    write_tokenizer(folder, spec, tokenizer, template, size.context)
    generation = {"bos_token_id": ids[spec.bos], "eos_token_id": ids[spec.end_of_turn],
                  "pad_token_id": ids[spec.pad], "transformers_version": transformers.__version__}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    mismatched = compare_weights(expected, reload_model(family, folder))
    if mismatched:
        raise SystemExit(f"{folder}: reloaded weights differ from the trained ones: {mismatched[:5]}")
    report = evaluate(folder, family, args, size, device)
    write_model_card(folder, family, spec, config, parameters, stats, log, report, args, device)
    print(f"  held-out code perplexity {report['code']['perplexity']:.2f} "
          f"({report['code']['bits_per_byte']:.3f} bits/byte), chat perplexity {report['chat']['perplexity']:.2f}",
          flush=True)
    if "reference" in report:
        agreement = report["reference"]
        print(f"  tools/kimi_k3_reference.forward (float64) vs the reloaded module (float32, {agreement['device']}) on "
              f"the last {agreement['tokens']} tokens of the tool-call prompt: max relative error "
              f"{agreement['relative_error']:.2e} (max |diff| {agreement['max_abs_error']:.2e}, max |logit| "
              f"{agreement['max_abs_logit']:.1f}, same argmax: {agreement['same_argmax']})", flush=True)
    print("  smallest top-k gaps: " + ", ".join(f"{site} {gap:.1e}" for site, gap in report["topk_gaps"].items()),
          flush=True)
    print(f"  fibonacci: {report['samples']['code'][:200]!r}", flush=True)
    print(f"  tool call: {report['samples']['call'][:300]!r}  (right call: {report['samples']['call_ok']})", flush=True)
    print(f"  answer:    {report['samples']['answer'][:200]!r}  (uses 816: {report['samples']['answer_ok']})", flush=True)
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    print(f"  wrote {folder}: " + ", ".join(f"{n} {s / 1e6:.2f} MB" for n, s in sorted(sizes.items())), flush=True)


def write_model_card(folder: Path, family: str, spec: FamilySpec, config: dict, parameters: int, stats: dict,
                     log: TrainingLog, report: dict, args, device: torch.device):
    k3 = family in K3_MODULE_FAMILIES
    top, config = config, text_fields(config)
    embedding = 2 * config["vocab_size"] * config["hidden_size"]
    sparse = ""
    if config.get("index_topk") is not None:
        sparse = f"DSA index_topk {config['index_topk']} keys of a {config['max_position_embeddings']}-token context"
    elif "index_block_size" in config:
        sparse = (f"MSA {config['index_topk_blocks']} blocks of {config['index_block_size']} keys "
                  f"({config['index_topk_blocks'] * config['index_block_size']} keys, the current block always kept) "
                  f"of a {config['max_position_embeddings']}-token context")
    command = " ".join(["python3", "tools/train_small_models.py"] + sys.argv[1:])
    eval_command = (f"python3 tools/train_small_models.py --out {args.out} --family {family} --evaluate"
                    + (" --tiny" if args.tiny else ""))
    samples = report["samples"]
    fence = "~~~~"
    loader = "tools/kimi_k3_torch.py" if k3 else "transformers"
    if k3:
        la = config["linear_attn_config"]
        fp32 = "A_log, dt_bias, conv taps and routers' e_score_correction_bias float32"
        k3_rows = [
            f"| config.json | model_type `{top['model_type']}`, architectures {top['architectures']}, the text model's "
            f"fields under `text_config` (model_type `{config['model_type']}`); weights under `language_model.model.` "
            "and `language_model.lm_head.weight` |",
            f"| AttnRes | attn_res_block_size {config['attn_res_block_size']} (no residual stream: each sublayer reads a "
            "learned softmax mix of the embedding, the finished blocks and the current block's partial sum) |",
            f"| KDA | {la['num_heads']} heads x {la['head_dim']}, short conv {la['short_conv_kernel_size']}, full-rank "
            f"output gate, decay gate_lower_bound {la['gate_lower_bound']} |",
            f"| MLA | {config['num_attention_heads']} heads, q_lora_rank {config['q_lora_rank']}, kv_lora_rank "
            f"{config['kv_lora_rank']}, qk {config['qk_nope_head_dim']} + {config['qk_rope_head_dim']} (no RoPE), v "
            f"{config['v_head_dim']}, sigmoid output gate |",
            f"| MLPs | SiTU (beta {config['activation_situ_beta']}, linear beta {config['activation_situ_linear_beta']}); "
            f"latent MoE: experts of width {config['moe_intermediate_size']} on a {config['routed_expert_hidden_size']}-wide "
            f"latent (RMSNorm'd), {config['num_shared_experts']} shared expert, routed_scaling_factor "
            f"{config['routed_scaling_factor']} |",
        ]
    else:
        fp32 = "routers' e_score_correction_bias float32"
        k3_rows = []
    lines = [
        f"# sparrow small {family}",
        "",
        f"A tiny {spec.architecture}, trained from scratch by `tools/train_small_models.py` so that sparrow can be "
        "tested end to end on a model that predicts real text. It knows some Python and a synthetic tool-use "
        "chat format; it is not useful for anything else.",
        "",
        "| | |", "| --- | --- |",
        f"| parameters | {parameters:,} ({embedding:,} in the embedding and the output head) |",
        f"| layers | {config['num_hidden_layers']}, hidden size {config['hidden_size']} |",
        f"| layers by type | {describe_layers(config)} |",
        *k3_rows,
        f"| sparse attention | {sparse or 'none (KDA + dense MLA)'} |",
        f"| vocabulary | {config['vocab_size']} (byte-level BPE, `tokenizer.json`) |",
        f"| chat template | `{spec.template}` (in tokenizer_config.json); end of turn = eos = `{spec.end_of_turn}` |",
        f"| weights | bfloat16 ({fp32}), "
        f"{(folder / 'model.safetensors').stat().st_size / 1e6:.1f} MB |",
        "",
        "## Training",
        "",
        f"- Data: Python {sys.version.split()[0]} standard-library source ({stats['code_files']} files, "
        f"{stats['code_tokens']:,} tokens; held-out files excluded) and {stats['conversations']:,} synthetic "
        f"conversations ({stats['chat_tokens']:,} tokens, median {stats['chat_length_median']} tokens) from "
        "`tools/chat_corpus.py` rendered with the chat template: reasoning, calls to a calculator, a unit "
        "converter and a lookup table with the template's own tool-call syntax, tool results and answers from them.",
        f"- {log.steps:,} steps of {log.batch} windows x "
        f"{config['max_position_embeddings']} tokens ({log.tokens / 1e6:.1f} M tokens, {CHAT_FRACTION:.0%} of the windows "
        f"conversations, the others code) in {log.seconds / 60:.1f} min on {device_name(device)}; AdamW (peak lr {args.lr}, "
        "betas 0.9/0.95, weight decay 0.1, warm-up then cosine), "
        + ("bf16 autocast" if device.type == "cuda" else "fp32") + ", loss on every token.",
        f"- Sparse indexers distilled from the main attention by a KL loss (dense for the first "
        f"{DENSE_WARMUP:.0%} of the steps, on the selected keys afterwards)"
        + (f"; final KL {log.final_indexer_kl:.3f}" if log.final_indexer_kl is not None else " (none in this family)")
        + ". MoE routers balanced by moving e_score_correction_bias (largest expert load in the last step: "
        + (f"{log.expert_load_peak:.2f} x the mean" if log.expert_load_peak else "n/a") + ").",
        f"- Train loss (mean of the last steps): {log.first_loss:.3f} at the first step -> **{log.final_loss:.3f}**.",
        "  Loss over training: " + ", ".join(f"{s}: {v:.2f}" for s, v in log.history[:: max(1, len(log.history) // 12)])
        + ".",
        f"- Command: `{command}` (seed {args.seed}).",
        "",
        "## Evaluation",
        "",
        f"Measured by {loader} on the files of this folder (reloaded in float32): held-out Python "
        f"{report['held_out']}.",
        "",
        "| text | perplexity | bits per byte | tokens scored |", "| --- | --- | --- | --- |",
        f"| held-out standard-library code | {report['code']['perplexity']:.2f} | "
        f"{report['code']['bits_per_byte']:.3f} | {report['code']['tokens']:,} |",
        f"| held-out conversations (seed {args.seed + 1000}) | {report['chat']['perplexity']:.2f} | "
        f"{report['chat']['bits_per_byte']:.3f} | {report['chat']['tokens']:,} |",
        "",
        f"Re-measure: `{eval_command}`.",
        "",
        *([f"Agreement with the float64 reference `tools/kimi_k3_reference.py` (`forward` on the stored weights of "
           f"this folder, vs `tools/kimi_k3_torch.py` in float32 on {report['reference']['device']}) on the last "
           f"{report['reference']['tokens']} tokens of the tool-call chat prompt below: max relative error "
           f"**{report['reference']['relative_error']:.1e}** (max |difference| {report['reference']['max_abs_error']:.1e}, "
           f"largest logit {report['reference']['max_abs_logit']:.1f}; same greedy token at every position: "
           f"{report['reference']['same_argmax']}).", ""] if "reference" in report else []),
        "Smallest relative gap between the k-th and (k+1)-th candidate of each top-k (make_fixtures.GapMonitor; "
        "one forward over the two chat prompts below and four held-out windows): "
        + ", ".join(f"`{site}` {gap:.1e}" for site, gap in report["topk_gaps"].items())
        + f". Gaps under {DEFAULT_MIN_GAP:.0e} (the fixtures' threshold) are close enough to rounding that "
        "another fp32 implementation may select differently there; over long texts a trained model has some.",
        "",
        "## Samples (greedy)",
        "",
        f"`{samples['code_prompt']}` continued for {samples['tokens']} tokens:",
        "", fence + "python", samples["code_prompt"] + samples["code"], fence, "",
        "A chat with a tool call (user: \"What is 48 * 17?\", with the calculator, convert_units and lookup tools). "
        "The model's turn after the prompt (which ends with "
        f"`{samples['call_prompt_tail'][-60:]!r}`) - right tool and arguments: **{samples['call_ok']}**:",
        "", fence, samples["call"], fence, "",
        f"Its answer once the template has added the call and the tool's result `{{\"result\": 816}}` "
        f"(prompt ends with `{samples['answer_prompt_tail'][-60:]!r}`) - uses 816: **{samples['answer_ok']}**:",
        "", fence, samples["answer"], fence, "",
    ]
    (folder / "README.md").write_text("\n".join(lines), encoding="utf-8")


def describe_layers(config: dict) -> str:
    """Attention and MLP kind of each layer, e.g. "linear_attention + dense MLP, ..."."""
    count = config["num_hidden_layers"]
    if "linear_attn_config" in config:  # Kimi K3 (vLLM's KimiLinearConfig)
        kinds = []
        for l in range(count):
            attention = "KDA" if kimi_k3_torch.is_kda_layer(config, l) else "MLA"
            mlp = (f"latent MoE ({config['num_experts']} experts, top {config['num_experts_per_token']}, + shared)"
                   if kimi_k3_torch.is_moe_layer(config, l) else "dense SiTU MLP")
            kinds.append(f"{attention} + {mlp}")
        return ", ".join(kinds)
    attention = config.get("layer_types") or ["full_attention (MLA + DSA)"] * count
    mlp = config.get("mlp_layer_types") or ["dense" if i < config["first_k_dense_replace"] else "sparse"
                                            for i in range(count)]
    experts = config.get("n_routed_experts") or config.get("num_local_experts")
    names = {"dense": "dense MLP", "sparse": f"MoE ({experts} experts, top {config['num_experts_per_tok']})"}
    return ", ".join(f"{a} + {names[m]}" for a, m in zip(attention, mlp))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder that receives one folder per family")
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="only these (default: all)")
    parser.add_argument("--minutes", type=float, default=2.0, help="training time per family (default 2)")
    parser.add_argument("--steps", type=int, help="train this many steps instead of --minutes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models and corpus: a smoke test for a CPU")
    parser.add_argument("--evaluate", action="store_true", help="only re-measure the models already in --out")
    parser.add_argument("--templates", type=Path, default=TEMPLATES, help="folder of the chat templates")
    parser.add_argument("--batch-size", type=int, help=f"windows per step (default {FULL.batch}; {TINY.batch} with --tiny)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--print-every", type=float, default=10.0, help="seconds between progress lines")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(args.device)
    size = TINY if args.tiny else FULL
    for family in args.family or list(FAMILIES):
        run_family(family, args, size, device)


if __name__ == "__main__":
    main()
