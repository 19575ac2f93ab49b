#!/usr/bin/env python3
"""Trains the small test tokenizers of tests/data/tokenizers/<family>/ with Hugging Face `tokenizers`.

    python3 tools/make_test_tokenizers.py && python3 tools/tokenizer_corpus.py

Real tokenizers cannot be downloaded here, so each family gets a byte-level BPE of ~3,000 tokens, trained
on Python standard-library source and generated multilingual text, but configured exactly like the
family's real files:
  deepseek_v32  tokenizer.json as DeepSeek-V3/V3.2: empty normalizer Sequence, pre-tokenizer Sequence of
                three Isolated Splits (digits \\p{N}{1,3}; CJK/kana runs; the main pattern) then
                ByteLevel(add_prefix_space=false, use_regex=false); merges in "a b" string form;
                <｜begin▁of▁sentence｜>/<｜end▁of▁sentence｜>/<｜▁pad▁｜> at ids 0-2, the chat and tool
                markers after the BPE vocabulary.
  minimax_m3    tokenizer.json in the Qwen2 / MiniMax style: NFC normalizer, one Isolated Split with the
                Qwen2 pattern, ByteLevel; merges in ["a", "b"] pair form; MiniMax's ]~!b[ / [e~[ markers,
                <think>, <minimax:tool_call>.
  kimi_linear   tiktoken.model as Kimi ships it (base64 token bytes and rank per line; ranks = the 256
                bytes, then the merges in training order), trained with Kimi's pat_str, and
                tokenizer_config.json whose added_tokens_decoder names the reserved ids after the ranks
                ([BOS] first, <|im_end|>, <|im_user|>, ... as in Kimi-K2).
The same folders are what bundled test models copy as their tokenizer.
"""
import base64
import json
import os
import random
import sys
import sysconfig

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tokenizer_corpus import EMOJI, PUNCT, SCRIPTS  # noqa: E402
from tokenizer_reference import KIMI_PAT_STR  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "tokenizers")
VOCAB_SIZE = 3000

# DeepSeek-V3 tokenizer.json pre_tokenizer Splits, in order.
DEEPSEEK_SPLITS = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
]
# Qwen2 tokenizer.json Split pattern (MiniMax uses the same style).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def training_text(seed):
    """~4 MB: standard-library source plus Zipf-distributed pseudo-words in several scripts, so merges
    exist for CJK, kana, Hangul, Cyrillic, emoji and digits too."""
    rng = random.Random(seed)
    stdlib = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in sorted(os.listdir(stdlib))[:120]:
        if name.endswith(".py"):
            with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    for script, alphabet in SCRIPTS.items():
        words = ["".join(rng.choice(alphabet[:120]) for _ in range(rng.randint(1, 5))) for _ in range(400)]
        weights = [1 / (rank + 1) for rank in range(len(words))]
        for _ in range(300):
            line = rng.choices(words, weights, k=rng.randint(3, 20))
            sep = "" if script in ("han", "kana") else " "
            texts.append(sep.join(line) + rng.choice(PUNCT[-20:] + ["\n"]))
    texts += ["".join(rng.choices(EMOJI, k=rng.randint(1, 4))) for _ in range(500)]
    texts += [" ".join(str(rng.randint(0, 10 ** rng.randint(1, 8))) for _ in range(10)) for _ in range(300)]
    return texts


def train(pre_tokenizer, normalizer, special_tokens, seed):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=special_tokens)
    tokenizer.train_from_iterator(training_text(seed), trainer)
    return tokenizer


def added(content, special, normalized=False, lstrip=False, rstrip=False, single_word=False):
    return AddedToken(content, special=special, normalized=normalized, lstrip=lstrip, rstrip=rstrip,
                      single_word=single_word)


def write_json(path, value):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=2)
        f.write("\n")


def make_deepseek(folder):
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in DEEPSEEK_SPLITS]
    tokenizer = train(pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)]),
                      normalizers.Sequence([]), specials, seed=1)
    # After the BPE vocabulary, as in DeepSeek-V3.1/V3.2: place holders, <think>, FIM, chat and tool
    # markers. DeepSeek marks the chat/tool markers special=false (decode keeps them either way).
    tokenizer.add_special_tokens([added(f"<｜place▁holder▁no▁{i}｜>", True, normalized=True) for i in range(16)])
    tokenizer.add_tokens([added("<think>", False, normalized=True), added("</think>", False, normalized=True)])
    tokenizer.add_special_tokens([added(t, True, normalized=True)
                                  for t in ["<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>"]])
    tokenizer.add_tokens([added(t, False, normalized=True) for t in ["<｜User｜>", "<｜Assistant｜>"]])
    tokenizer.add_special_tokens([added("<|EOT|>", True, normalized=True)])
    tokenizer.add_tokens([added(t, False, normalized=True) for t in [
        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
        "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"]])
    tokenizer.post_processor = None
    data = json.loads(tokenizer.to_str())
    # DeepSeek's files: "a b" merges, a BOS template post-processor (unused: sparrow adds no BOS).
    data["model"]["merges"] = [f"{a} {b}" for a, b in data["model"]["merges"]]
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": specials[0], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": specials[0], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": specials[0], "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {specials[0]: {"id": specials[0], "ids": [0], "tokens": [specials[0]]}},
    }
    write_json(os.path.join(folder, "tokenizer.json"), data)

    def config_token(content):
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True,
                "rstrip": False, "single_word": False}
    write_json(os.path.join(folder, "tokenizer_config.json"), {
        "add_bos_token": True, "add_eos_token": False, "bos_token": config_token(specials[0]),
        "eos_token": config_token(specials[1]), "pad_token": config_token(specials[1]),
        "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": 131072,
        "tokenizer_class": "LlamaTokenizerFast", "unk_token": None, "use_default_system_prompt": False,
    })


def make_minimax(folder):
    specials = ["]!p~[", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<reponame>", "<filename>",
                "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>",
                "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<empty_output>", "<commit_before>",
                "<commit_msg>", "<commit_after>", "]~b]", "[e~[", "]!d~[", "<function_call>", "<code_interpreter>",
                "]<]speech[>[", "]<]image[>[", "]<]video[>[", "]<]start of speech[>[", "]<]end of speech[>[",
                "]<]start of image[>[", "]<]end of image[>[", "]<]start of video[>[", "]<]end of video[>[",
                "]<]vision pad[>[", "]~!b["]
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer = train(pre, normalizers.NFC(), specials, seed=2)
    tokenizer.add_tokens([added(t, False) for t in ["<think>", "</think>", "<minimax:tool_call>",
                                                    "</minimax:tool_call>"]])
    data = json.loads(tokenizer.to_str())
    data["pre_tokenizer"]["pretokenizers"][1]["trim_offsets"] = False
    data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": False}
    write_json(os.path.join(folder, "tokenizer.json"), data)
    write_json(os.path.join(folder, "tokenizer_config.json"), {
        "add_prefix_space": False, "bos_token": "]~!b[", "eos_token": "[e~[", "unk_token": "]!d~[",
        "clean_up_tokenization_spaces": False, "model_max_length": 40960000,
        "tokenizer_class": "GPT2Tokenizer",
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                 for t in data["added_tokens"]},
    })


# Kimi-K2's tokenizer_config.json names these reserved ids (offsets after the BPE ranks); the others
# are <|reserved_token_{id}|>.
KIMI_NAMED_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}


def make_kimi(folder):
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated", invert=False),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer = train(pre, None, [], seed=3)
    model = json.loads(tokenizer.to_str())["model"]
    byte_of = {ch: b for b, ch in byte_level_chars().items()}

    def token_bytes(token):
        return bytes(byte_of[c] for c in token)
    # Ranks: the 256 single bytes, then every merge result in training order.
    ranked = [bytes([b]) for b in range(256)] + [token_bytes(a) + token_bytes(b) for a, b in model["merges"]]
    assert len(set(ranked)) == len(ranked)
    with open(os.path.join(folder, "tiktoken.model"), "w", encoding="ascii") as f:
        for rank, token in enumerate(ranked):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    base = len(ranked)
    decoder = {str(base + offset): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                    "single_word": False, "special": True}
               for offset, name in sorted(KIMI_NAMED_SPECIALS.items())}
    write_json(os.path.join(folder, "tokenizer_config.json"), {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "clean_up_tokenization_spaces": False, "eos_token": "[EOS]",
        "model_max_length": 1048576, "pad_token": "[PAD]", "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    })


def byte_level_chars():
    """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def main():
    for family, make in [("deepseek_v32", make_deepseek), ("minimax_m3", make_minimax), ("kimi_linear", make_kimi)]:
        folder = os.path.join(DATA, family)
        os.makedirs(folder, exist_ok=True)
        make(folder)
        print(f"wrote {folder}")


if __name__ == "__main__":
    main()
