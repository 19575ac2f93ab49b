#!/usr/bin/env python3
"""Writes the fixtures of PEFT's form for stacked experts: an adapter PEFT itself saves over a bundled
model's routed experts, and the prompt logprobs transformers gives with the adapter active.

    python3 tools/make_lora_peft_fixture.py        # tests/fixtures/lora_peft_experts/{deepseek_v32,minimax_m3}

transformers 5 holds a MoE layer's experts as two stacked parameters (experts.gate_up_proj [E, 2I, H],
experts.down_proj [E, H, I]); PEFT adapts them through LoraConfig.target_parameters and saves
`<moe>.experts.base_layer.lora_A/B` (gate_up) and `<moe>.experts.lora_A/B` (down), lora_A [E * r, in] and
lora_B [out, r * E]. tests/lora_test.cpp checks that sparrow, reading that form, gives transformers' logprobs
over a prompt longer than the sparse budgets. Needs torch, transformers 5.17 and peft (0.21.2 made these)."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 200  # past deepseek_v32's index_topk (128) and minimax_m3's 4 blocks of 32


def make(model_name: str, out: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ROOT / "models" / model_name, dtype=torch.float32)
    stacks = sorted({".".join(n.split(".")[-3:]) for n, _ in model.named_parameters()
                     if n.endswith(("experts.gate_up_proj", "experts.down_proj"))})
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=stacks))
    draw = torch.Generator().manual_seed(1)
    with torch.no_grad():  # PEFT starts B at zero: both random, so the adapter matters
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=draw) * 0.5 / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=draw) * 0.15)
    if out.exists():
        shutil.rmtree(out)
    peft_model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)
    config = json.loads((out / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = f"models/{model_name}"  # not this machine's path
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    prompt = [int(t) for t in torch.randint(2, model.config.vocab_size, (PROMPT_TOKENS,), generator=draw)]

    def prompt_logprobs() -> list[float]:
        with torch.no_grad():
            logprobs = torch.log_softmax(peft_model(torch.tensor([prompt])).logits[0].double(), -1)
        return [float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))]

    reference = {"prompt": prompt, "prompt_logprobs": prompt_logprobs()}
    peft_model.disable_adapter_layers()
    reference["base_prompt_logprobs"] = prompt_logprobs()
    (out / "reference.json").write_text(json.dumps(reference))
    moved = max(abs(a - b) for a, b in zip(reference["prompt_logprobs"], reference["base_prompt_logprobs"]))
    print(f"{out}: {len(stacks)} stacks, the adapter moves prompt logprobs by up to {moved:.2f}")


def main() -> None:
    names = sys.argv[1:] or ["deepseek_v32", "minimax_m3"]
    for name in names:
        make(name, ROOT / "tests" / "fixtures" / "lora_peft_experts" / name)


if __name__ == "__main__":
    main()
