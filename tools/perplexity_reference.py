#!/usr/bin/env python3
"""The perplexity transformers measures on a text file, computed exactly as `sparrow perplexity` does,
so that tests/text_cli_test.cpp can check sparrow against it (within 0.5%).

The recipe (shared with src/cli/perplexity_command.cpp):
  ids     = the tokenizer's ids of the whole file (no special tokens added; a BOS first only when
            tokenizer_config.json says add_bos_token)
  windows = consecutive, non-overlapping runs of W = min(context, 1024) ids, where context is
            config.json's max_position_embeddings (else model_max_length, else 1024); the last window
            may be shorter, and a window of one id is skipped (it predicts nothing)
  score   = in each window, one forward over its ids; token i+1 is scored by the log-softmax of
            position i (the first id of each window is not predicted)
  result  = perplexity exp(mean NLL), with the number of tokens scored and the mean NLL in nats

The models are loaded in float32 by tools/make_fixtures.py's load_model (transformers' own classes;
kimi_k3 through its KimiK3ForCausalLM).

Usage: python3 tools/perplexity_reference.py --text tests/data/perplexity/imghdr.py.txt \
           --model models/minimax_m3 --model models/kimi_k3 --model models/deepseek_v32 \
           --out tests/data/perplexity/reference.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import load_model  # noqa: E402

MAX_WINDOW = 1024

# config.json model_type -> make_fixtures.load_model's family name
FAMILY_OF_MODEL_TYPE = {
    "minimax_m3_vl_text": "minimax_m3",
    "kimi_k3": "kimi_k3",
    "kimi_linear": "kimi_linear",
    "deepseek_v32": "deepseek_v32",
}


def window_size(config: dict) -> int:
    context = config.get("max_position_embeddings") or config.get("model_max_length") or MAX_WINDOW
    return min(int(context), MAX_WINDOW)


def text_ids(folder: Path, text: str) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    if tokenizer_config.get("add_bos_token") and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return ids


@torch.no_grad()
def perplexity(folder: Path, text: str) -> dict:
    config = json.loads((folder / "config.json").read_text())
    family = FAMILY_OF_MODEL_TYPE[config["model_type"]]
    model = load_model(family, folder)
    ids = text_ids(folder, text)
    window = window_size(config)
    total_nll, scored = 0.0, 0
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            continue
        input_ids = torch.tensor([chunk])
        logits = model(input_ids=input_ids, use_cache=False).logits[0].float()
        total_nll += F.cross_entropy(logits[:-1], input_ids[0, 1:], reduction="sum").item()
        scored += len(chunk) - 1
    mean_nll = total_nll / scored
    return {"perplexity": math.exp(mean_nll), "mean_nll": mean_nll, "tokens": scored, "window": window}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, required=True, help="UTF-8 text file to score")
    parser.add_argument("--model", type=Path, action="append", required=True, help="model folder (repeatable)")
    parser.add_argument("--out", type=Path, help="JSON file to write (default: print)")
    args = parser.parse_args()
    text = args.text.read_text(encoding="utf-8")
    results = {folder.name: perplexity(folder, text) for folder in args.model}
    report = {"text": args.text.name, "transformers": transformers.__version__, "torch": torch.__version__,
              "dtype": "float32", "models": results}
    out = json.dumps(report, indent=2) + "\n"
    if args.out:
        args.out.write_text(out)
    print(out, end="")


if __name__ == "__main__":
    main()
