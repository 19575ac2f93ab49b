#!/usr/bin/env python3
"""Writes tokenizer.json and tokenizer_config.json for the two vision-language fixtures, so that the server can
serve them (chat template, image parts): tests/fixtures/minimax_m3_vl and tests/fixtures/kimi_k3_vl, both with
256-token vocabularies. Byte-level BPE without merges: the newline and the printable ASCII bytes first (ids 0-95),
then other bytes up to id 239 (HF tokenizers renumbers added tokens after a gap, so the ids run without one), and
the family's special tokens at the top of the vocabulary:
  MiniMax-M3  the image placeholder at the fixture's image_token_index (250), the video one at 251, and the start /
              end of image tokens vLLM 0.33.0 wraps each image's placeholders in (models/minimax_m3/common/
              mm_preprocess.py) beside them; the chat template is the bundled model's (MiniMax-M3's).
  Kimi K3     <|media_pad|> at the fixture's media_placeholder_token_id (250), the template's
              <|kimi_image_placeholder|>, and the <|media_begin|> / <|media_content|> / <|media_end|> vLLM's prompt
              update writes around an image's pads (models/kimi_k3/common/mm_preprocess.py), with the chat template's
              own tokens; the chat template is the bundled kimi_k3's (Kimi K3's).

    python3 tools/make_vl_tokenizers.py
"""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
MODELS = ROOT / "models"

MINIMAX_SPECIAL = {240: "]!p~[", 241: "]!d~[", 242: "]~!b[", 243: "]~b]", 244: "[e~[", 245: "]<]minimax[>[",
           246: "<mm:think>", 247: "</mm:think>", 248: "]<]start of image[>[", 249: "]<]end of image[>[",
           250: "]<]image[>[", 251: "]<]video[>["}
KIMI_SPECIAL = {240: "[BOS]", 241: "<|end_of_msg|>", 242: "<|open|>", 243: "<|sep|>", 244: "<|close|>",
                245: "<think>", 246: "</think>", 247: "<|media_begin|>", 248: "<|media_content|>", 249: "<|media_end|>",
                250: "<|media_pad|>", 251: "<|kimi_image_placeholder|>", 252: "[PAD]"}


def byte_symbol(b):
    """GPT-2's printable stand-in for a byte (bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def write(fixture: Path, special: dict[int, str], chat_template: str, bos: str, eos: str, pad: str | None,
          sample: str, must_hold: tuple[int, ...]):
    bundled = json.loads((MODELS / "minimax_m3" / "tokenizer.json").read_text())  # its byte-level pre-tokenizer
    first = [10] + list(range(32, 127))
    others = [b for b in range(256) if b not in first]
    vocab = {byte_symbol(b): i for i, b in enumerate((first + others)[:min(special)])}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, c in sorted(special.items())],
        "normalizer": bundled["normalizer"],
        "pre_tokenizer": bundled["pre_tokenizer"],
        "post_processor": None,
        "decoder": bundled["decoder"],
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    (fixture / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1, ensure_ascii=False) + "\n")
    config = json.loads((MODELS / "minimax_m3" / "tokenizer_config.json").read_text())
    config.update({"chat_template": chat_template, "bos_token": bos, "eos_token": eos, "pad_token": pad})
    config["added_tokens_decoder"] = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                               "single_word": False, "special": True} for i, c in special.items()}
    (fixture / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    from tokenizers import Tokenizer  # check: every id fits the fixture's vocabulary, the specials are whole
    t = Tokenizer.from_file(str(fixture / "tokenizer.json"))
    ids = t.encode(sample, add_special_tokens=False).ids
    assert max(ids) < 256 and all(i in ids for i in must_hold), ids
    print(f"{fixture.name}: {len(vocab)} byte tokens, {len(special)} special; sample {ids}")


def main():
    minimax = json.loads((MODELS / "minimax_m3" / "tokenizer_config.json").read_text())
    write(FIXTURES / "minimax_m3_vl", MINIMAX_SPECIAL, minimax["chat_template"], minimax["bos_token"],
          minimax["eos_token"], minimax.get("pad_token"), "]~b]user\nWhat is in ]<]image[>[ this picture?[e~[\n",
          (250, 243))
    kimi = json.loads((MODELS / "kimi_k3" / "tokenizer_config.json").read_text())
    write(FIXTURES / "kimi_k3_vl", KIMI_SPECIAL, kimi["chat_template"], "[BOS]", "<|end_of_msg|>", "[PAD]",
          "<|open|>user<|sep|>What is in <|kimi_image_placeholder|>?<|end_of_msg|><|media_begin|>image 9x7"
          "<|media_content|><|media_pad|><|media_end|>", (251, 250, 247, 248, 249, 242, 243))


if __name__ == "__main__":
    main()
