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

The models are loaded in float32 by tools/make_fixtures.py's load_model (transformers' own classes);
kimi_k3, which transformers does not have, runs through tools/kimi_k3_reference.py in float64.

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
import kimi_k3_reference  # noqa: E402

MAX_WINDOW = 1024

# config.json model_type -> make_fixtures.load_model's family name
FAMILY_OF_MODEL_TYPE = {
    "minimax_m3_vl_text": "minimax_m3",
    "kimi_linear": "kimi_linear",
    "deepseek_v32": "deepseek_v32",
}


def window_size(config: dict) -> int:
    text = config.get("text_config", config)  # as src/cli/common.cpp model_positions reads it
    context = text.get("max_position_embeddings") or text.get("model_max_length") or MAX_WINDOW
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
    if config["model_type"] == "kimi_k3":
        from safetensors.torch import load_file
        weights = load_file(folder / "model.safetensors")
        forward = lambda input_ids: kimi_k3_reference.forward(config, weights, input_ids[0].tolist())  # noqa: E731
    else:
        model = load_model(FAMILY_OF_MODEL_TYPE[config["model_type"]], folder)
        forward = lambda input_ids: model(input_ids=input_ids, use_cache=False).logits[0]  # noqa: E731
    ids = text_ids(folder, text)
    window = window_size(config)
    total_nll, scored = 0.0, 0
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            continue
        input_ids = torch.tensor([chunk])
        logits = forward(input_ids).double()
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
