#!/usr/bin/env python3
"""Writes the tokenizer test corpus and the expectations that tests/tokenizer_test.cpp checks.

    python3 tools/tokenizer_corpus.py            # corpus.json + expected.json of every test tokenizer

Outputs, under tests/data/tokenizers/:
  corpus.json                 {"texts": [...]}: hard strings (CJK, emoji, combining marks, whitespace
                              runs, digits, code, special tokens inside text, ...), over 10,000 in all.
  <family>/expected.json      what the reference library (tools/tokenizer_reference.py) gives:
                                "encode": [[count, digest], ...] for every corpus text,
                                "roundtrip_changed": {index: decode(encode(text))} where that is not
                                the text itself (NFC, for one),
                                "decode_ids"/"decode_texts": random id sequences and their decoded text
                                (random ids make invalid UTF-8 and split special tokens).
  variants_expected.json      the same "encode" digests for the tokenizer.json variants of
                              variants.json (options the three families do not use), on a prefix
                              of the corpus.

Digests are FNV-1a 64 of the compact JSON (tokenizer_reference.digest) to keep the files small; the live
test (tests/tokenizer_live_test.py) shows full ids when something differs.
"""
import json
import os
import random
import sys
import sysconfig
import unicodedata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tokenizer_reference import apply_patch, digest, load_reference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "tokenizers")
FAMILIES = ["deepseek_v32", "minimax_m3", "kimi_linear"]
VARIANT_TEXTS = 1000      # corpus prefix the variants are checked on
DECODE_SEQUENCES = 1500   # random id sequences per tokenizer


def chars(first, last):
    return "".join(chr(c) for c in range(first, last + 1) if unicodedata.category(chr(c)) != "Cn")


# Letters of several scripts. Only long-assigned code points: the libraries and PCRE2 carry different
# Unicode versions, and newly assigned characters would be letters in one and unassigned in another.
SCRIPTS = {
    "latin": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "accented": "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßœÀÉÎÕÜŁłŒşğİıǅǈ",
    "greek": chars(0x3B1, 0x3C9) + chars(0x391, 0x3A9),
    "cyrillic": chars(0x430, 0x44F) + chars(0x410, 0x42F),
    "arabic": chars(0x621, 0x64A),
    "hebrew": chars(0x5D0, 0x5EA),
    "devanagari": chars(0x905, 0x939) + chars(0x93E, 0x94C),
    "thai": chars(0xE01, 0xE2E) + chars(0xE30, 0xE3A),
    "hangul": "".join(chr(0xAC00 + i * 37) for i in range(300)),
    "kana": chars(0x3041, 0x3096) + chars(0x30A1, 0x30FA) + "ー",
    "han": "".join(chr(0x4E00 + (i * 97) % 0x51A5) for i in range(600)) + "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
}
COMBINING = chars(0x300, 0x36F) + "\u0591\u05B0\u064B\u064E\u0650\u093C\u094D\u0E31\u0E48\u20D7\u3099\u309A"
EMOJI = ["😀", "🎉", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "🇯🇵", "❤️", "🤖", "🧑🏿‍💻", "✈︎", "🫠", "©", "™", "🔥", "🍣",
         "1️⃣", "#️⃣", "🐍", "👩🏻‍🔬"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n", "\u00a0", "\u3000", "\u2003", "\u202f",
          "\u180e", "\u0085", "\u2028", "\u200b", "\x0b", "\x0c", "\x1c"]
DIGITS = "0123456789" + "٠١٢٣٤٥٦٧٨٩" + "０１２３４５６７８９" + "²³¹½¼⅓ⅫⅣ" + "१२३" + "〇"
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + list("，。、！？：；「」『』（）《》…—–‘’“”«»¿¡·•§¶€£¥₹")
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'LL", "'D", "'ſ", "’s"]

# Special and added tokens of the three test tokenizers (tools/make_test_tokenizers.py), written
# inside ordinary text: each family sees the others' as plain text.
SPECIAL_STRINGS = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<think>", "</think>", "<｜User｜>",
    "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>", "<|EOT|>", "<｜fim▁hole｜>", "<｜place▁holder▁no▁1｜>", "<｜place▁holder▁no▁12｜>",
    "]~!b[", "]~b]", "[e~[", "]!p~[", "]!d~[", "<minimax:tool_call>", "</minimax:tool_call>", "<fim_prefix>",
    "<filename>", "]<]image[>[", "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
    "<|im_system|>", "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>", "[EOT]", "[PAD]",
    "<|reserved_token_3005|>", "<|start_header_id|>",
    # near misses: prefixes, wrong brackets, case
    "<think", "think>", "<THINK>", "<｜User", "<|im_end|", "[BOS", "<<think>>", "</think></think>",
]

# Hand-picked strings, each aimed at one rule.
HARD_STRINGS = [
    "", " ", "a", "  ", "\n", "Hello world", " Hello world", "Hello  world ", "hello\tworld\n",
    "I'm sure it's fine, we'll see; they'd've known. DON'T SHOUT! I'M HERE'S", "'s's'S 'ſ",
    "naïve café résumé", "e\u0301 vs \u00e9", "A\u030a vs \u00c5 vs \u212b", "\u1e9b\u0323",
    "\u1100\u1161\u11a8 vs \uac01", "Ω vs \u2126", "ﬁ ﬂ ﬀ", "\u0958 \u0915\u093c", "\u2000\u2001",
    "ḍ̇ q̣̇ ǭ", "a\u0328\u0301", "\u0061\u0315\u0300\u05ae\u0300\u0062",
    "你好，世界！", "中文English混合123", "日本語のテキスト、カタカナ。", "한국어 텍스트입니다", "々〆〇ヶ",
    "Привет, мир!", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก",
    "😀😀😀", "👨‍👩‍👧‍👦 family", "🏳️‍🌈🇫🇷🇯🇵", "👍🏽👍🏿", "1️⃣2️⃣", "emoji🎉in🎉words",
    "1234567890", "3.14159265358979", "1,000,000", "١٢٣٤٥", "１２３", "²³ ½ Ⅻ", "v1.2.3-rc4", "0x1F600",
    "          ", " " * 100, "\n" * 20, "\t\t\t\tindent", "a \n b \r\n c", " \u00a0 \u00a0 ", "x\u180ey",
    "x\u0085y", "x\u2028y\u2029z", "end with spaces   ", "   start with spaces", "\r\n\r\n\r\n",
    "def f(x):\n    return x ** 2  # square\n", "if (a && b || !c) { return *p->q; }",
    "<div class=\"x\">a &amp; b</div>", "SELECT * FROM t WHERE id = 42;", "$ ls -la | grep '^d'",
    "{\"key\": [1, 2, {\"nested\": null}]}", "https://example.com/path?q=1&r=2#frag",
    "<think>reasoning</think>answer", "<think>\n\n</think>\n\n", "a<｜User｜>b", "x <｜tool▁sep｜> y",
    "<<think>>", "<think><think>", "</think>", "[BOS]hi[EOS]", "<|im_end|><|im_end|>", "<|im_end",
    "]~!b[]~b]system\nhi[e~[\n", "<minimax:tool_call>\n<invoke name=\"f\">\n</minimax:tool_call>",
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
    "<|tool_call_end|><|tool_calls_section_end|>", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}",
    "  <think>  ", "word<think>word", "<｜place▁holder▁no▁1｜><｜place▁holder▁no▁12｜>",
    "\ufeffBOM", "\u200dzwj\u200c", "\ufffd replacement", "tab\tseparated\tvalues", "mixed\u3000space",
]


def random_piece(rng):
    kind = rng.choices(
        ["word", "script", "digits", "space", "punct", "emoji", "combining", "contraction", "special", "code"],
        weights=[20, 18, 8, 14, 10, 4, 4, 3, 4, 3])[0]
    if kind == "word":
        return "".join(rng.choice(SCRIPTS["latin"]) for _ in range(rng.randint(1, 9)))
    if kind == "script":
        alphabet = SCRIPTS[rng.choice(list(SCRIPTS))]
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7)))
    if kind == "digits":
        return "".join(rng.choice(DIGITS[:10] if rng.random() < 0.7 else DIGITS) for _ in range(rng.randint(1, 12)))
    if kind == "space":
        return "".join(rng.choice(SPACES) for _ in range(rng.randint(1, 4))) * rng.choice([1, 1, 1, 3])
    if kind == "punct":
        return "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 4)))
    if kind == "emoji":
        return rng.choice(EMOJI)
    if kind == "combining":
        base = rng.choice(SCRIPTS["latin"] + SCRIPTS["accented"] + SCRIPTS["greek"])
        return base + "".join(rng.choice(COMBINING) for _ in range(rng.randint(1, 3)))
    if kind == "contraction":
        return rng.choice(CONTRACTIONS)
    if kind == "special":
        return rng.choice(SPECIAL_STRINGS)
    return rng.choice(["()", "[]", "{}", "->", "=>", "::", "!=", "==", "&&", "||", "/*", "*/", "#", "@", "\\n"])


def random_texts(rng, count):
    texts = []
    for _ in range(count):
        pieces = [random_piece(rng) for _ in range(rng.randint(1, 14))]
        glue = rng.choice(["", " ", " ", ""])
        texts.append(glue.join(pieces))
    return texts


def source_texts(rng, count):
    """Lines and small blocks of Python standard-library source: real code and English comments."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(stdlib) if f.endswith(".py"))
    texts = []
    while len(texts) < count:
        name = rng.choice(files)
        with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines(keepends=True)
        if not lines:
            continue
        start = rng.randrange(len(lines))
        texts.append("".join(lines[start:start + rng.choice([1, 1, 2, 3, 6])]))
    return texts


def long_texts(rng):
    """A few long strings: long whitespace and digit runs, a long single word, a whole code file."""
    stdlib = sysconfig.get_paths()["stdlib"]
    return [
        " " * 3000, "\n" * 500 + "x", "\t " * 700, "9" * 2000, "ab" * 1500, "你" * 1000,
        "".join(rng.choice(SCRIPTS["han"]) for _ in range(1500)), "😀" * 300,
        "".join(random_piece(rng) for _ in range(600)),
        open(os.path.join(stdlib, "textwrap.py"), encoding="utf-8").read()[:8000],
    ]


def make_corpus():
    rng = random.Random(20260801)
    texts = HARD_STRINGS + [s for s in SPECIAL_STRINGS] + random_texts(rng, 6500) + source_texts(rng, 3500) \
        + long_texts(rng)
    # Every text is valid UTF-8 by construction (Python str without surrogates).
    return texts


def random_id_sequences(rng, vocab_size, count):
    sequences = []
    for _ in range(count):
        length = rng.choice([1, 1, 2, 3, 5, 8, 13])
        sequences.append([rng.randrange(vocab_size) for _ in range(length)])
    return sequences


def family_expectations(folder, texts):
    reference = load_reference(folder)
    ids = reference.encode(texts)
    rng = random.Random(7 + reference.vocab_size)
    decode_ids = random_id_sequences(rng, reference.vocab_size, DECODE_SEQUENCES)
    return {
        "vocab_size": reference.vocab_size,
        "encode": [[len(x), digest(x)] for x in ids],
        "roundtrip_changed": {str(i): t for i, t in enumerate(reference.decode(ids)) if t != texts[i]},
        "decode_ids": decode_ids,
        "decode_texts": reference.decode(decode_ids),
    }


def variant_expectations(texts):
    import tempfile
    variants = json.load(open(os.path.join(DATA, "variants.json"), encoding="utf-8"))["variants"]
    out = {}
    for variant in variants:
        base = json.load(open(os.path.join(DATA, variant["base"], "tokenizer.json"), encoding="utf-8"))
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
                json.dump(apply_patch(base, variant["patch"]), f, ensure_ascii=False)
            ids = load_reference(tmp).encode(texts)
        out[variant["name"]] = [[len(x), digest(x)] for x in ids]
    return out


def dump(path, value):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


def main():
    texts = make_corpus()
    dump(os.path.join(DATA, "corpus.json"), {"texts": texts})
    for family in FAMILIES:
        dump(os.path.join(DATA, family, "expected.json"), family_expectations(os.path.join(DATA, family), texts))
    dump(os.path.join(DATA, "variants_expected.json"), variant_expectations(texts[:VARIANT_TEXTS]))
    print(f"{len(texts)} texts; expectations written for {', '.join(FAMILIES)} and the variants")


if __name__ == "__main__":
    main()
