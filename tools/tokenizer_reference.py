"""The reference tokenizers that sparrow's C++ tokenizers must equal, loaded from a model folder.

Shared by tools/make_test_tokenizers.py, tools/tokenizer_corpus.py and tests/tokenizer_live_test.py:
  * a folder with tokenizer.json is Hugging Face `tokenizers` (encode without BOS/EOS, decode keeping
    special tokens);
  * a folder with tiktoken.model is Kimi's tokenizer: `tiktoken.Encoding` with the pattern and the
    special-token numbering of Kimi's tokenization_kimi.py, encoding with allowed_special="all".
"""
import base64
import json
import os

# TikTokenTokenizer.pat_str in Kimi's tokenization_kimi.py (Kimi-K2 / Kimi-Linear), alternative by
# alternative. `&&` is a character-class intersection (Rust regex syntax).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# tokenization_kimi.py reserves this many special-token ids right after the BPE ranks.
KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256


def digest(value):
    """FNV-1a 64 of the compact JSON form of `value` (a list of ids, or a string), as 16 hex digits.

    tests/tokenizer_test.cpp computes the same digest, so expectations stay small."""
    data = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    h = 0xCBF29CE484222325
    for byte in data:
        h ^= byte
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def read_tiktoken_ranks(path):
    """tiktoken.model: one "<base64 bytes> <rank>" per line (read here rather than with
    tiktoken.load, whose cache keys on the path and would serve a stale file after regeneration)."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f.read().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def kimi_special_tokens(num_base_tokens, tokenizer_config):
    """{text: id} as tokenization_kimi.py builds it: names from added_tokens_decoder, the other
    reserved ids named <|reserved_token_{id}|>."""
    names = {int(i): t["content"] for i, t in tokenizer_config.get("added_tokens_decoder", {}).items()}
    ids = range(num_base_tokens, num_base_tokens + KIMI_NUM_RESERVED_SPECIAL_TOKENS)
    return {names.get(i, f"<|reserved_token_{i}|>"): i for i in ids}


class HfReference:
    skips_unknown_ids = True  # decode() drops ids with no token

    def __init__(self, folder):
        from tokenizers import Tokenizer
        self.tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, texts):
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, id_lists):
        return self.tokenizer.decode_batch(id_lists, skip_special_tokens=False)


class TiktokenReference:
    skips_unknown_ids = False  # decode() raises on ids with no token

    def __init__(self, folder):
        import tiktoken
        ranks = read_tiktoken_ranks(os.path.join(folder, "tiktoken.model"))
        config_path = os.path.join(folder, "tokenizer_config.json")
        config = json.load(open(config_path, encoding="utf-8")) if os.path.exists(config_path) else {}
        specials = kimi_special_tokens(len(ranks), config)
        self.encoding = tiktoken.Encoding(name="kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=specials)
        self.vocab_size = self.encoding.n_vocab

    def encode(self, texts):
        return [self.encoding.encode(t, allowed_special="all") for t in texts]

    def decode(self, id_lists):
        return [self.encoding.decode(ids) for ids in id_lists]


def load_reference(folder):
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return HfReference(folder)
    if os.path.exists(os.path.join(folder, "tiktoken.model")):
        return TiktokenReference(folder)
    raise SystemExit(f"{folder}: no tokenizer.json or tiktoken.model")


def apply_patch(tokenizer_json, patch):
    """Sets each "a.b.c" key path of `patch` in the tokenizer.json object. In a list, a path element is
    an index, or the content of an added token. tests/data/tokenizers/variants.json describes variants
    this way; tests/tokenizer_test.cpp applies the same rule."""
    def child(node, key):
        if isinstance(node, dict):
            return key
        if key.isdigit():
            return int(key)
        return next(i for i, item in enumerate(node) if item.get("content") == key)

    for path, value in patch.items():
        node = tokenizer_json
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[child(node, key)]
        node[child(node, keys[-1])] = value
    return tokenizer_json
