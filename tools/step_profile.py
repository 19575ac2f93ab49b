#!/usr/bin/env python3
"""Kernel by kernel: one decode step of `sparrow bench forward` under Nsight Compute, grouped, or two builds side
by side (bench/results/kernels.md, "Small kernels at batch 1", was made this way).

On the GPU machine (eager steps, so every launch is a kernel ncu sees; one metric, so one pass per launch):

    ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv --print-units base \\
        sparrow bench forward --device cuda --model SHAPE_DIR --load-format dummy \\
        --moe-routing-simulation uniform_random --prompt-tokens 2048 --decode-tokens 3 --batch 1 --repeats 1 \\
        --enforce-eager > step.csv

Then, anywhere:

    python3 tools/step_profile.py step.csv                  # the last step, grouped by kernel
    python3 tools/step_profile.py before.csv after.csv      # two builds, with the difference per kernel
    python3 tools/step_profile.py step.csv --jsonl raw.jsonl --meta gpu=H100 --meta commit=abc1234

The last step is taken from the last launch of the embedding kernel to the end of the file: a decode step starts
with the embedding, and the command above ends with decode steps. Lines that are not ncu's CSV (the benchmark's
JSON line, ncu's "==PROF==" lines) are skipped; "1,234" style numbers are read. Kernels are grouped by their base
name (no template arguments or parameters, no sparrow:: or cuda:: scope), so a kernel instantiated several ways is
one row; --jsonl keeps every launch with its full name, grid and block.

The times are ncu's, each launch alone: a graph replay overlaps a launch's front end with the kernel before it,
so a step under graphs is shorter than the sum, and a kernel that gets faster here saves less there (kernels.md
measured 1.8% end to end where this table predicted ~10%). Use the table to find where the time goes, and
`bench forward` with graphs to say what a change saved.
"""
import argparse
import csv
import json
import re
import sys
from collections import OrderedDict


def read_launches(lines):
    """[(name, block, grid, microseconds)] in launch order, from ncu --csv output lines."""
    header = None
    launches = []
    for row in csv.reader(lines):
        if not row:
            continue
        if header is None:
            if row[0] == "ID" and "Kernel Name" in row:
                header = {name: i for i, name in enumerate(row)}
            continue
        if not row[0].isdigit() or len(row) < len(header):
            continue
        if row[header["Metric Name"]] != "gpu__time_duration.sum":
            continue
        value = float(row[header["Metric Value"]].replace(",", ""))
        unit = row[header["Metric Unit"]]
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit)
        if scale is None:
            raise ValueError(f"unknown time unit {unit!r} (run ncu with --print-units base)")
        launches.append((row[header["Kernel Name"]], row[header["Block Size"]], row[header["Grid Size"]], value * scale))
    if header is None:
        raise ValueError("no ncu CSV header (ID, ..., Kernel Name, ...) found")
    return launches


def last_step(launches, first_kernel="embedding_kernel"):
    """The launches from the last one whose base name is `first_kernel` to the end."""
    starts = [i for i, (name, _, _, _) in enumerate(launches) if base_name(name) == first_kernel]
    if not starts:
        raise ValueError(f"no {first_kernel} launch: not a sparrow decode step?")
    return launches[starts[-1]:]


def base_name(name):
    """'void sparrow::<unnamed>::rms_norm_kernel<bf16, 16>(const T1 *, long)' -> 'rms_norm_kernel',
    'void skinny::kernel<sparrow::DenseJob<1>, 1, 1>(T1)' -> 'skinny::kernel'."""
    name = re.sub(r"^void ", "", name)
    name = name.replace("<unnamed>::", "").replace("(anonymous namespace)::", "")
    depth, out = 0, []
    for ch in name:  # drop template arguments, keeping the scope separators outside them
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    name = "".join(out).split("(")[0]
    while name.startswith(("sparrow::", "cuda::")):  # our own namespaces say nothing; others (skinny::) do
        name = name.split("::", 1)[1]
    return name


def group(launches):
    """OrderedDict base name -> [launches, microseconds], in first-launch order."""
    groups = OrderedDict()
    for name, _, _, us in launches:
        entry = groups.setdefault(base_name(name), [0, 0.0])
        entry[0] += 1
        entry[1] += us
    return groups


def table(steps, labels):
    """Markdown: one row per kernel, sorted by the largest time in any step; a difference column for two."""
    groups = [group(s) for s in steps]
    names = list(OrderedDict.fromkeys(n for g in groups for n in g))
    names.sort(key=lambda n: -max(g.get(n, [0, 0.0])[1] for g in groups))
    head = "| kernel | " + " | ".join(f"{label} launches | {label} µs" for label in labels)
    head += " | difference µs |" if len(steps) == 2 else " |"
    rule = "| --- |" + " ---: | ---: |" * len(steps) + (" ---: |" if len(steps) == 2 else "")
    lines = [head, rule]
    for n in names:
        cells = []
        for g in groups:
            count, us = g.get(n, [0, 0.0])
            cells += [str(count), f"{us:.1f}"]
        row = f"| {n} | " + " | ".join(cells)
        if len(steps) == 2:
            row += f" | {groups[1].get(n, [0, 0.0])[1] - groups[0].get(n, [0, 0.0])[1]:+.1f}"
        lines.append(row + " |")
    totals = []
    for s in steps:
        totals += [str(len(s)), f"{sum(us for *_, us in s):.1f}"]
    total_row = "| **step** | " + " | ".join(totals)
    if len(steps) == 2:
        total_row += f" | {sum(us for *_, us in steps[1]) - sum(us for *_, us in steps[0]):+.1f}"
    lines.append(total_row + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="+", help="ncu --csv output of one build, or of two to compare")
    parser.add_argument("--jsonl", help="write the (first) file's last step here, one launch a line, after a meta line")
    parser.add_argument("--meta", action="append", default=[], help="key=value for the meta line (gpu, commit, shape)")
    args = parser.parse_args(argv)
    if len(args.csv) > 2:
        parser.error("one file, or two to compare")
    steps = []
    for path in args.csv:
        with open(path, encoding="utf-8", errors="replace") as f:
            steps.append(last_step(read_launches(f)))
    labels = ["before", "after"] if len(steps) == 2 else ["step"]
    print(table(steps, labels))
    if args.jsonl:
        meta = {"metric": "gpu__time_duration.sum per launch (ncu), the last decode step"}
        for item in args.meta:
            key, sep, value = item.partition("=")
            if not sep:
                parser.error(f"--meta {item!r}: expected key=value")
            meta[key] = value
        with open(args.jsonl, "w", encoding="utf-8") as out:
            out.write(json.dumps({"meta": meta}) + "\n")
            for name, block, grid, us in steps[0]:
                out.write(json.dumps({"kernel": name, "block": block, "grid": grid, "us": round(us, 3)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
