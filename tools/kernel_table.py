#!/usr/bin/env python3
"""Merges kernel benchmark JSON lines (sparrow's and its peers') into one markdown table.

    python3 tools/kernel_table.py out/kernels/*.jsonl [--out kernels.md]

Each input line is a JSON object with kernel, shape, impl, median_us and optionally bytes, flops, note
(`sparrow bench kernels --json`, bench/peers/*.py). Lines that are not JSON objects (comments, logs) are skipped.
One table row per (kernel, shape):

  kernel | shape | sparrow µs | TB/s | TFLOP/s | % of limit | torch µs | flashmla µs | speedup vs best peer | other sparrow kernels

TB/s, TFLOP/s and % of limit come from sparrow's row (its hand-counted minimum bytes and FLOPs):
% of limit = max(bytes / 4.3e12 B/s, flops / peak) / time, the fraction of the H200's roofline bound reached.
The peak is the dense bf16 rate, 790 TFLOP/s, also for kernels whose operands are stored in FP8, unless the
row says its matrix products themselves run in FP8, then 1580 TFLOP/s: `"fp8_products": true` (what `sparrow
bench kernels` writes), or, in lines without that field (peers, and sparrow's lines before it existed), a note
saying so ("fp8 mma", "fp8 matmul", "fp8 gemm", "fp8 flops" or "fp8 tensor"). "torch µs" is the fastest impl whose name starts with "torch"; other peers
count toward the best peer and are listed under the table. Impls named "sparrow-<variant>" are sparrow's own
other kernels for the operation (e.g. the one it used before); they are shown in the last column as
"variant µs", never as peers. Speedup = best peer µs / sparrow µs (> 1: sparrow
is faster). Shapes are matched on their name, key=value fields and dtype words in any order; a "topk=" field
present on one side only is ignored (dense kernels have none).
"""
import argparse
import json
import math
import re
import sys

HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS_PER_S = 790e12
FP8_FLOPS_PER_S = 1580e12
FP8_MMA = re.compile(r"\bfp8[ _-]?(mma|matmul|gemm|flops|tensor)", re.IGNORECASE)


def runs_fp8_products(row):
    """Whether a row's FLOPs count against the FP8 peak: its fp8_products field, else its note."""
    if "fp8_products" in row:
        return bool(row["fp8_products"])
    return bool(FP8_MMA.search(str(row.get("note") or "")))


def parse_shape(shape):
    """'<name> k=v ... flag' -> (name, {k: v}, sorted flags)."""
    tokens = shape.split()
    if not tokens:
        return "", {}, ()
    fields, flags = {}, []
    for tok in tokens[1:]:
        if "=" in tok:
            k, v = tok.split("=", 1)
            fields[k] = v
        else:
            flags.append(tok)
    return tokens[0], fields, tuple(sorted(flags))


def shape_key(kernel, shape, drop=()):
    name, fields, flags = parse_shape(shape)
    return (kernel, name, tuple(sorted((k, v) for k, v in fields.items() if k not in drop)), flags)


def read_rows(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    print(f"kernel_table: {path}: skipped a line that is not JSON", file=sys.stderr)
                    continue
                if not isinstance(row, dict) or not {"kernel", "shape", "impl"} <= row.keys():
                    continue
                rows.append(row)
    return rows


def as_time(value):
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if v > 0 and math.isfinite(v) else None


def fmt(v, digits=1):
    if v is None:
        return ""
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.{digits}f}" if abs(v) >= 1 else f"{v:.{digits + 1}f}"


def numeric_sort_key(shape):
    name, fields, flags = parse_shape(shape)
    def num(v):
        try:
            return (0, float(v), "")
        except ValueError:
            return (1, 0.0, v)
    order = ["heads", "ctx", "batch", "q", "topk"]
    keyed = [num(fields[k]) if k in fields else (2, 0.0, "") for k in order]
    rest = sorted((k, v) for k, v in fields.items() if k not in order)
    return (keyed, rest, flags)


def build_table(rows):
    """Returns (markdown lines, notes)."""
    groups = {}   # full key -> {"kernel", "shape", "impls": {impl: row}}
    order = []
    for row in rows:
        key = shape_key(row["kernel"], row["shape"])
        if key not in groups:
            groups[key] = {"kernel": row["kernel"], "shape": row["shape"], "impls": {}}
            order.append(key)
        impls = groups[key]["impls"]
        prev = impls.get(row["impl"])
        # Repeated measurements of one impl: keep the fastest.
        if prev is None or (as_time(row.get("median_us")) or math.inf) < (as_time(prev.get("median_us")) or math.inf):
            impls[row["impl"]] = row
        if row["impl"] == "sparrow":
            groups[key]["shape"] = row["shape"]

    # A peer group with no sparrow row whose shape differs only by a one-sided topk= folds into sparrow's.
    def loose(key):
        kernel, name, fields, flags = key
        return (kernel, name, tuple(kv for kv in fields if kv[0] != "topk"), flags)
    sparrow_by_loose = {loose(k): k for k in order if "sparrow" in groups[k]["impls"]}
    for key in list(order):
        g = groups[key]
        if "sparrow" in g["impls"]:
            continue
        target = sparrow_by_loose.get(loose(key))
        if target is None or target == key:
            continue
        has_topk = lambda k: any(kv[0] == "topk" for kv in k[2])
        if has_topk(key) and has_topk(target):
            continue  # both name a topk and they differ: not the same shape
        for impl, r in g["impls"].items():
            groups[target]["impls"].setdefault(impl, r)
        order.remove(key)

    kernels_order = []
    for key in order:
        if groups[key]["kernel"] not in kernels_order:
            kernels_order.append(groups[key]["kernel"])
    names_order = []
    for key in order:
        if key[1] not in names_order:
            names_order.append(key[1])
    order.sort(key=lambda k: (kernels_order.index(k[0]), names_order.index(k[1]), numeric_sort_key(groups[k]["shape"])))

    other_peers = set()
    lines = [
        "| kernel | shape | sparrow µs | TB/s | TFLOP/s | % of limit | torch µs | flashmla µs | speedup vs best peer "
        "| other sparrow kernels |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for key in order:
        g = groups[key]
        impls = g["impls"]
        sp = impls.get("sparrow")
        sp_us = as_time(sp.get("median_us")) if sp else None
        ref = sp or next(iter(impls.values()))
        bytes_ = float(ref.get("bytes") or 0)
        flops = float(ref.get("flops") or 0)
        peak = FP8_FLOPS_PER_S if runs_fp8_products(ref) else BF16_FLOPS_PER_S
        tbs = tfs = pct = None
        if sp_us:
            secs = sp_us * 1e-6
            tbs = bytes_ / secs / 1e12 if bytes_ else None
            tfs = flops / secs / 1e12 if flops else None
            bound = max(bytes_ / HBM_BYTES_PER_S, flops / peak)
            pct = 100.0 * bound / secs if bound > 0 else None

        torch_us = [as_time(r.get("median_us")) for i, r in impls.items() if i.startswith("torch")]
        torch_best = min((t for t in torch_us if t), default=None)
        fm = impls.get("flashmla")
        fm_us = as_time(fm.get("median_us")) if fm else None
        own = lambda i: i == "sparrow" or i.startswith("sparrow-")
        peers = [as_time(r.get("median_us")) for i, r in impls.items() if not own(i)]
        for i in impls:
            if not own(i) and not i.startswith("torch") and i != "flashmla":
                other_peers.add(i)
        variants = ", ".join(f"{i[len('sparrow-'):]} {fmt(as_time(r.get('median_us')))}"
                             for i, r in sorted(impls.items()) if i.startswith("sparrow-") and as_time(r.get("median_us")))
        best_peer = min((t for t in peers if t), default=None)
        speedup = f"{best_peer / sp_us:.2f}x" if (best_peer and sp_us) else ""

        def cell(row, t):
            if row is None:
                return ""
            return fmt(t) if t else "fail"
        torch_cell = fmt(torch_best) if torch_best else ("fail" if any(i.startswith("torch") for i in impls) else "")
        lines.append(
            f"| {g['kernel']} | {g['shape']} | {cell(sp, sp_us)} | {fmt(tbs, 2)} | {fmt(tfs)} | "
            f"{fmt(pct) + '%' if pct is not None else ''} | {torch_cell} | {cell(fm, fm_us)} | {speedup} | {variants} |")
    notes = []
    if other_peers:
        notes.append("Other peers counted in the best peer: " + ", ".join(sorted(other_peers)) + ".")
    return lines, notes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="JSON-lines files")
    ap.add_argument("--out", help="write the table here instead of stdout")
    args = ap.parse_args(argv)
    rows = read_rows(args.inputs)
    lines, notes = build_table(rows)
    text = "\n".join(lines) + "\n"
    if notes:
        text += "\n" + "\n".join(notes) + "\n"
    text += (f"\nLimits: HBM {HBM_BYTES_PER_S / 1e12:.1f} TB/s, bf16 {BF16_FLOPS_PER_S / 1e12:.0f} TFLOP/s "
             f"(fp8 {FP8_FLOPS_PER_S / 1e12:.0f} where the note says the products run in FP8). "
             "Speedup = best peer µs / sparrow µs.\n")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
