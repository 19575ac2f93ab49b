#!/usr/bin/env python3
"""Draw the serving Pareto front of `sparrow bench sweep` (docs/bench.md, "Sweep and roofline").

Axes as InferenceX / AgentX draw them (SemiAnalysis InferenceX, utils/process_result.py): x is
interactivity, output tokens per second per user = 1000 / TPOT (ms); y is throughput per GPU, total
(input + output) tokens per second / GPUs (--y output: output tokens only). Each point is one
concurrency; a curve joins an engine's points.

Inputs:
  SWEEP ...                 sweep JSONs written by `sparrow bench sweep` (each one curve, named by its
                            label; the first one's decode roofline is drawn dashed and its serving
                            limit, prefill included, dotted, once: they belong to the model and
                            workload, which every curve shares)
  --peer LABEL=PATH[,PATH]  a peer's curve: `vllm bench serve --save-result` files (one per concurrency,
                            read from their max_concurrency), folders of them, globs, or a sweep JSON

  python3 tools/plot_sweep.py bench/results/serve/sweep-sparrow-deepseek.json \
      --peer 'vllm=bench/results/serve/vllm-deepseek/*.json' --output bench/results/serve/deepseek

writes deepseek.png and deepseek.svg.
"""
import argparse
import glob
import json
import os
import sys


def tpot_key(stat):
    return "median_tpot_ms" if stat == "median" else "mean_tpot_ms"


def point_from_result(result, gpus, stat):
    """One point from a bench serve result (sparrow's or vLLM's --save-result fields)."""
    tpot = result.get(tpot_key(stat))
    concurrency = result.get("max_concurrency") or result.get("concurrency")
    if not tpot or tpot <= 0 or not result.get("completed"):
        return None
    return {
        "concurrency": concurrency,
        "x": 1000.0 / tpot,
        "total": float(result.get("total_token_throughput", 0.0)) / gpus,
        "output": float(result.get("output_throughput", 0.0)) / gpus,
    }


def points_from_sweep(sweep, stat):
    """Points, roofline and serving limit of a sparrow sweep JSON."""
    gpus = sweep.get("num_gpus", 1) or 1
    points, roofline, serving = [], [], []
    for p in sweep.get("points", []):
        tpot = p.get(tpot_key(stat))
        if not tpot or tpot <= 0 or not p.get("completed"):
            continue
        points.append({
            "concurrency": p["concurrency"],
            "x": 1000.0 / tpot,
            "total": p.get("tokens_per_s_per_gpu", float(p.get("total_token_throughput", 0.0)) / gpus),
            "output": p.get("output_tokens_per_s_per_gpu", float(p.get("output_throughput", 0.0)) / gpus),
        })
        r = p.get("roofline")
        if r:
            roofline.append({
                "concurrency": p["concurrency"],
                "x": r["tokens_per_s_per_user"],
                "total": r.get("total_tokens_per_s_per_gpu", r["tokens_per_s_per_gpu"]),
                "output": r["tokens_per_s_per_gpu"],
                "bound": r.get("bound", ""),
            })
        lim = p.get("serving_limit")
        if lim:
            serving.append({
                "concurrency": p["concurrency"],
                "x": lim["tokens_per_s_per_user"],
                "total": lim["total_tokens_per_s_per_gpu"],
                "output": lim["output_tokens_per_s_per_gpu"],
                "bound": lim.get("bound", ""),
            })
    return points, roofline, serving


def expand(paths):
    files = []
    for path in paths.split(","):
        path = path.strip()
        if not path:
            continue
        if os.path.isdir(path):
            files += sorted(glob.glob(os.path.join(path, "*.json")))
        elif any(c in path for c in "*?["):
            files += sorted(glob.glob(path))
        else:
            files.append(path)
    return files


def load_curve(label, paths, gpus, stat):
    """A curve from sweep JSONs and/or per-concurrency result JSONs."""
    points, roofline, serving = [], [], []
    for path in expand(paths):
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and data.get("kind") == "sparrow-bench-sweep":
            p, r, lim = points_from_sweep(data, stat)
            points += p
            roofline += r
            serving += lim
            label = label or data.get("label", os.path.basename(path))
        else:
            p = point_from_result(data, gpus, stat)
            if p:
                points.append(p)
            else:
                print(f"plot_sweep: {path}: no completed requests or no TPOT, skipped", file=sys.stderr)
    points.sort(key=lambda p: p["concurrency"] or 0)
    roofline.sort(key=lambda p: p["concurrency"] or 0)
    serving.sort(key=lambda p: p["concurrency"] or 0)
    return {"label": label or "?", "points": points, "roofline": roofline, "serving": serving}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweeps", nargs="*", help="sparrow sweep JSONs")
    ap.add_argument("--peer", action="append", default=[], help="LABEL=PATH[,PATH...] (vLLM result files, folders, globs)")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs behind the peers' result files (per-GPU throughput)")
    ap.add_argument("--tpot", choices=["median", "mean"], default="median",
                    help="TPOT statistic of interactivity = 1000 / TPOT (InferenceX reports both)")
    ap.add_argument("--y", choices=["total", "output"], default="total",
                    help="throughput per GPU: total (input + output) tokens, as InferenceX, or output tokens only")
    ap.add_argument("--log", action="store_true", help="logarithmic axes")
    ap.add_argument("--no-roofline", action="store_true", help="leave the roofline out")
    ap.add_argument("--title", default="", help="figure title (default: the first sweep's model and workload)")
    ap.add_argument("--output", required=True, help="output path without extension: writes .png and .svg")
    args = ap.parse_args()

    curves, title = [], args.title
    for path in args.sweeps:
        curves.append(load_curve(None, path, args.gpus, args.tpot))
        if not title:
            with open(path) as f:
                sweep = json.load(f)
            cost = sweep.get("model_cost") or {}
            workload = sweep.get("workload", {})
            shape = (f"{workload.get('input_len')}/{workload.get('output_len')}"
                     if sweep.get("dataset_name") == "random" else sweep.get("dataset_name", ""))
            title = f"{cost.get('model_type', sweep.get('model_id', ''))} ({cost.get('layers', '?')} layers), {shape}"
    for spec in args.peer:
        if "=" not in spec:
            ap.error(f"--peer {spec!r}: expected LABEL=PATH[,PATH...]")
        label, paths = spec.split("=", 1)
        curves.append(load_curve(label, paths, args.gpus, args.tpot))
    if not curves:
        ap.error("nothing to draw: give a sweep JSON or --peer")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # One roofline: it is the model's and the workload's (same folder, same requests for every engine), so
    # the first curve that carries one draws it; a peer's sweep JSON repeats it at its own points.
    roofline_drawn = False
    for i, curve in enumerate(curves):
        color = colors[i % len(colors)]
        pts = sorted(curve["points"], key=lambda p: p["x"])
        if pts:
            ax.plot([p["x"] for p in pts], [p[args.y] for p in pts], "o-", color=color, label=curve["label"])
            for p in pts:
                ax.annotate(f"c{p['concurrency']}", (p["x"], p[args.y]), textcoords="offset points", xytext=(4, 4),
                            fontsize=7, color=color)
        roof = sorted(curve["roofline"], key=lambda p: p["x"])
        if roof and not args.no_roofline and not roofline_drawn:
            ax.plot([p["x"] for p in roof], [p[args.y] for p in roof], "--", color="0.35",
                    label="roofline (decode: HBM / FLOP limit)")
            serving = sorted(curve.get("serving", []), key=lambda p: p["x"])
            if serving:
                ax.plot([p["x"] for p in serving], [p[args.y] for p in serving], ":", color="0.15",
                        label="serving limit (prompts' prefill + decode)")
            roofline_drawn = True
    ax.set_xlabel(f"Interactivity: output tokens/s per user (1000 / {args.tpot} TPOT)")
    ax.set_ylabel("Throughput per GPU: " + ("total (input + output)" if args.y == "total" else "output") + " tokens/s")
    if args.log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(f"{args.output}.{ext}", dpi=150)
    print(f"wrote {args.output}.png and {args.output}.svg")


if __name__ == "__main__":
    main()
