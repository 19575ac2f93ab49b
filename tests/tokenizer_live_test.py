#!/usr/bin/env python3
"""Compares `sparrow tokenize` / `sparrow detokenize` with Hugging Face `tokenizers` and `tiktoken`, live.

    python3 tests/tokenizer_live_test.py --sparrow build/sparrow [--seed N]

For every test tokenizer in tests/data/tokenizers (and every tokenizer.json variant of variants.json):
  * encode the committed corpus (10,000+ hard strings) and a fresh batch of random strings drawn from
    all assigned code points (seeded, printed), ids must be identical;
  * decode the corpus ids and random id sequences (invalid UTF-8, split and unknown ids), texts must be
    identical.
Exits 77 (ctest SKIP_RETURN_CODE) when the Python libraries are missing, 1 on any difference.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "tokenizers")
SKIP = 77

try:
    import tiktoken  # noqa: F401
    import tokenizers  # noqa: F401
except ImportError as e:
    print(f"SKIP: the reference libraries are not installed ({e}); pip install tokenizers tiktoken")
    sys.exit(SKIP)

sys.path.insert(0, os.path.join(ROOT, "tools"))
from tokenizer_corpus import FAMILIES, random_piece  # noqa: E402
from tokenizer_reference import apply_patch, load_reference  # noqa: E402


def run_sparrow(sparrow, command, model, payload):
    with tempfile.NamedTemporaryFile("w", suffix=".json", encoding="utf-8", delete=False) as f:
        json.dump(payload, f)
        path = f.name
    try:
        result = subprocess.run([sparrow, command, "--model", model, "--input", path], capture_output=True)
    finally:
        os.unlink(path)
    if result.returncode != 0:
        raise SystemExit(f"sparrow {command} failed: {result.stderr.decode(errors='replace').strip()}")
    return json.loads(result.stdout.decode("utf-8"))


def random_texts(rng, count):
    """Strings from every assigned code point (no surrogates or private use) mixed with corpus pieces."""
    pool = [c for c in range(0x20, 0x30000) if unicodedata.category(chr(c)) not in ("Cn", "Cs", "Co")]
    texts = []
    for _ in range(count):
        parts = [chr(rng.choice(pool)) if rng.random() < 0.5 else random_piece(rng) for _ in range(rng.randint(1, 16))]
        texts.append("".join(parts))
    return texts


def random_ids(rng, vocab_size, count, allow_unknown):
    top = vocab_size + (8 if allow_unknown else 0)  # tokenizers skips unknown ids; tiktoken raises
    return [[rng.randrange(top) for _ in range(rng.randint(0, 16))] for _ in range(count)]


class Results:
    def __init__(self):
        self.passed = self.failed = 0

    def compare(self, name, inputs, got, expected):
        bad = [i for i in range(len(inputs)) if got[i] != expected[i]]
        if bad:
            self.failed += 1
            print(f"FAIL {name}: {len(bad)} of {len(inputs)} differ")
            for i in bad[:5]:
                print(f"  input    {ascii(inputs[i])[:300]}\n  sparrow  {ascii(got[i])[:300]}\n"
                      f"  expected {ascii(expected[i])[:300]}")
        else:
            self.passed += 1
            print(f"ok   {name}: {len(inputs)} equal")


def check_tokenizer(results, sparrow, name, folder, texts, rng):
    reference = load_reference(folder)
    expected_ids = reference.encode(texts)
    got_ids = run_sparrow(sparrow, "tokenize", folder, {"texts": texts})["ids"]
    results.compare(f"{name} encode", texts, got_ids, expected_ids)

    id_lists = expected_ids + random_ids(rng, reference.vocab_size, 3000, reference.skips_unknown_ids)
    got_texts = run_sparrow(sparrow, "detokenize", folder, {"ids": id_lists})["texts"]
    results.compare(f"{name} decode", id_lists, got_texts, reference.decode(id_lists))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sparrow", required=True, help="the sparrow binary")
    parser.add_argument("--seed", type=int, default=None, help="seed of the random strings (default: fresh)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"tokenizer live test, seed {seed} (rerun with --seed {seed})")
    rng = random.Random(seed)

    corpus = json.load(open(os.path.join(DATA, "corpus.json"), encoding="utf-8"))["texts"]
    texts = corpus + random_texts(rng, 3000)
    results = Results()
    for family in FAMILIES:
        check_tokenizer(results, args.sparrow, family, os.path.join(DATA, family), texts, rng)

    variants = json.load(open(os.path.join(DATA, "variants.json"), encoding="utf-8"))["variants"]
    for variant in variants:
        base = json.load(open(os.path.join(DATA, variant["base"], "tokenizer.json"), encoding="utf-8"))
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
                json.dump(apply_patch(base, variant["patch"]), f, ensure_ascii=False)
            check_tokenizer(results, args.sparrow, f"variant {variant['name']}", folder, texts, rng)

    print(f"{results.passed} passed, {results.failed} failed")
    sys.exit(1 if results.failed else 0)


if __name__ == "__main__":
    main()
