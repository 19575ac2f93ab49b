#!/usr/bin/env python3
"""Print the markdown table of bench/results/serve.md from sweep JSONs (`sparrow bench sweep`'s, or a peer's
written by the same client), one row per point, so the page's tables come from the raw files.

  python3 tools/sweep_table.py [--engine NAME] SWEEP.json [--engine NAME SWEEP.json ...]

A SWEEP may also be a folder of per-concurrency results in `vllm bench serve --save-result`'s fields (the HF
peer's hf-concurrency<c>.json, bench/peers/hf_serve_peer.py): those carry no limits, so their rows take the
roofline and serving limit of the table's first sweep JSON at the same concurrency (the same model and
workload: every engine of a table shares them).

Columns: the point's request counts, median TTFT and TPOT, tokens/s per user (1000 / median TPOT, the plot's
x axis), total and output tokens/s per GPU, the decode roofline at that batch and context and the fraction
of it reached, the serving limit (the prompts' prefill counted too, roofline.h) and the fraction of it; for
a sparrow sweep also the engine's own decode step time, the
share of a step spent on the host, and the prefill steps it ran (the /metrics counters the sweep records).
"""
import argparse
import glob
import json
import os
import sys

COLUMNS = ["engine", "concurrency", "completed", "median TTFT ms", "median TPOT ms", "tok/s/user",
           "total tok/s/GPU", "output tok/s/GPU", "roofline tok/s/user", "of roofline",
           "serving limit tok/s/user", "of serving limit", "decode step ms (engine)", "host share",
           "prefill steps, mean ms"]


def number(value, digits=0):
    if value is None:
        return ""
    return f"{value:,.{digits}f}"


def completed(point):
    """"3 of 4", or why the point has no figures (a server that died before it)."""
    if "error" in point:
        return "none: " + point["error"].split(";")[0]
    total = point.get("num_prompts", point.get("completed", 0) + (point.get("failed") or 0))
    return f"{point.get('completed', 0)} of {total}"


def rows(engine, sweep):
    for p in sweep["points"]:
        roof = p.get("roofline") or {}
        per_user = p.get("tokens_per_s_per_user")
        limit = roof.get("tokens_per_s_per_user")
        serving = (p.get("serving_limit") or {}).get("tokens_per_s_per_user")
        steps = p.get("engine_steps") or {}
        decode, prefill = steps.get("decode") or {}, steps.get("prefill") or {}
        if not p.get("completed"):  # a point that failed whole has no figures, only its count
            yield [engine, str(p["concurrency"]), completed(p)] + [""] * (len(COLUMNS) - 3)
            continue
        yield [
            engine,
            str(p["concurrency"]),
            completed(p),
            number(p.get("median_ttft_ms")),
            number(p.get("median_tpot_ms"), 2),
            number(per_user, 1),
            number(p.get("tokens_per_s_per_gpu")),
            number(p.get("output_tokens_per_s_per_gpu")),
            number(limit, 1),
            f"{100 * per_user / limit:.0f}%" if per_user and limit else "",
            number(serving, 1),
            f"{100 * per_user / serving:.0f}%" if per_user and serving else "",
            number(decode.get("mean_step_ms"), 2),
            f"{100 * decode['host_fraction']:.0f}%" if "host_fraction" in decode else "",
            f"{prefill['steps']:.0f} x {prefill['mean_step_ms']:.0f}" if prefill.get("steps") else "",
        ]


def sweep_from_results(folder, limits):
    """A sweep's points from a folder of per-concurrency results, with `limits` (concurrency -> the first
    sweep's point) lending the roofline and serving limit."""
    points = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            result = json.load(f)
        c = result.get("max_concurrency")
        if c is None:
            raise ValueError(f"{path}: no max_concurrency (not a bench serve result)")
        tpot = result.get("median_tpot_ms")
        point = {"concurrency": c, "completed": result.get("completed", 0), "failed": result.get("failed", 0),
                 "num_prompts": result.get("num_prompts"), "median_ttft_ms": result.get("median_ttft_ms"),
                 "median_tpot_ms": tpot, "tokens_per_s_per_user": 1000.0 / tpot if tpot else None,
                 "tokens_per_s_per_gpu": result.get("total_token_throughput"),
                 "output_tokens_per_s_per_gpu": result.get("output_throughput")}
        for key in ("roofline", "serving_limit"):
            point[key] = (limits.get(c) or {}).get(key)
        points.append(point)
    if not points:
        raise ValueError(f"{folder}: no result JSONs")
    return {"label": os.path.basename(os.path.normpath(folder)), "points": sorted(points, key=lambda p: p["concurrency"])}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("items", nargs="+", metavar="[--engine NAME] SWEEP.json")
    # --engine applies to the files after it; parsed by hand to keep the pairs in order.
    engine, table, limits = None, [], None
    args = list(argv)
    if not args or args[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if args else 2
    while args:
        item = args.pop(0)
        if item == "--engine":
            if not args:
                parser.error("--engine needs a name")
            engine = args.pop(0)
            continue
        try:
            if os.path.isdir(item):
                sweep = sweep_from_results(item, limits or {})
            else:
                with open(item) as f:
                    sweep = json.load(f)
        except (OSError, ValueError) as error:
            parser.error(f"{item}: {error}")
        if "points" not in sweep:
            parser.error(f"{item}: not a sweep JSON (no 'points')")
        if limits is None and not os.path.isdir(item):
            limits = {p["concurrency"]: p for p in sweep["points"]}
        table.extend(rows(engine or sweep.get("label") or "sparrow", sweep))
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in table:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
