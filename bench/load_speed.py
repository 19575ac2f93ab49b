#!/usr/bin/env python3
"""Checkpoint load speed against the disk's own read speed (issue 22 item 4), on the GPU machine.

  python3 bench/load_speed.py --sparrow build/sparrow --dir /tmp/load_ckpt --out OUT [--gb 16]

1. Writes a bf16 checkpoint of DeepSeek-V3.2's layer widths (bench/shapes/deepseek_v3.2.json: 7168 wide,
   MLA + DSA, 2048-wide experts) cut to a few layers and experts so that it is about --gb gigabytes, in
   shards of ~4 GB, as transformers would name it (names and shapes from transformers' own
   DeepseekV32ForCausalLM on the meta device; the values are zeros: loading does not look at them).
2. Evicts the shards from the page cache (posix_fadvise DONTNEED: no root needed) and reads them with
   `dd bs=16M` for the disk's sequential read speed.
3. Evicts them again and times `sparrow generate --device cuda` on it (one token): the loader's own
   "loaded X GB of weights in Y s (Z GB/s)" line, cold; then once more with the shards in the page cache
   (host memory's speed, the upper bound of the path from the files to the GPU).
Writes OUT/load_speed.json (every figure, the commands, the machine) and prints a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARD_BYTES = 4 << 30


def build_config(gb: float) -> dict:
    shape = json.loads((ROOT / "bench/shapes/deepseek_v3.2.json").read_text())
    config = {k: v for k, v in shape.items() if not k.startswith("_") and k != "quantization_config"}
    config["dtype"] = "bfloat16"
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    expert_bytes = 3 * inter * hidden * 2
    # 1 dense layer + MoE layers of 64 experts until the size is reached (the rest: embeddings, head, MLA).
    experts = 64
    fixed = 2 * config["vocab_size"] * hidden * 2 + 1 * 3 * config["intermediate_size"] * hidden * 2
    moe_layers = max(1, round((gb * 1e9 - fixed) / (experts * expert_bytes + 0.5e9)))
    config.update(num_hidden_layers=1 + moe_layers, first_k_dense_replace=1, n_routed_experts=experts,
                  num_nextn_predict_layers=0)
    return config


def write_checkpoint(folder: Path, config: dict) -> list[Path]:
    import torch
    import transformers
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    shapes = [(name, tuple(t.shape), t.dtype) for name, t in model.state_dict().items()]
    shards, current, size = [], {}, 0
    def flush():
        nonlocal current, size
        if current:
            path = folder / f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, path, metadata={"format": "pt"})
            shards.append(path)
            current, size = {}, 0
    weight_map = {}
    for name, shape, dtype in shapes:
        t = torch.zeros(shape, dtype=dtype)
        current[name] = t
        size += t.numel() * t.element_size()
        weight_map[name] = f"model-{len(shards) + 1:05d}.safetensors"
        if size >= SHARD_BYTES:
            flush()
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(dict(config, architectures=["DeepseekV32ForCausalLM"])))
    for path in shards:  # on the disk before anything is timed
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    return shards


def evict(paths: list[Path]):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd_read(paths: list[Path]) -> tuple[float, float]:
    total = sum(p.stat().st_size for p in paths)
    start = time.perf_counter()
    for path in paths:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    seconds = time.perf_counter() - start
    return total / 1e9 / seconds, seconds


def sparrow_load(sparrow: str, folder: Path, load_format: str) -> dict:
    prompt = folder / "prompt.json"
    prompt.write_text(json.dumps({"prompts": [[1, 2, 3]]}))
    cmd = [sparrow, "generate", "--device", "cuda", "--model", str(folder), "--load-format", load_format,
           "--prompt-ids", str(prompt), "--max-tokens", "1"]
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    m = re.search(r"loaded ([\d.]+) GB of weights in ([\d.]+) s \(([\d.]+) GB/s\)", r.stderr)
    out = {"command": " ".join(cmd), "returncode": r.returncode, "wall_s": wall, "stderr_tail": r.stderr[-800:]}
    if m:
        out.update(gb=float(m.group(1)), seconds=float(m.group(2)), gb_per_s=float(m.group(3)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sparrow", default=str(ROOT / "build/sparrow"))
    p.add_argument("--dir", type=Path, default=Path("/tmp/load_ckpt"))
    p.add_argument("--out", type=Path, default=ROOT / "out")
    p.add_argument("--gb", type=float, default=16.0)
    args = p.parse_args()
    config = build_config(args.gb)
    t0 = time.perf_counter()
    shards = write_checkpoint(args.dir, config)
    written = time.perf_counter() - t0
    total_gb = sum(s.stat().st_size for s in shards) / 1e9
    print(f"wrote {total_gb:.1f} GB in {len(shards)} shards in {written:.0f} s", flush=True)
    result = {"checkpoint_gb": total_gb, "shards": len(shards), "layers": config["num_hidden_layers"],
              "experts": config["n_routed_experts"], "write_s": written}
    evict(shards)
    result["dd_gb_per_s"], result["dd_s"] = dd_read(shards)
    print(f"dd (cold): {result['dd_gb_per_s']:.2f} GB/s", flush=True)
    # (auto, safetensors and fastsafetensors are one path, docs/cli.md: the shards read ahead in parallel.)
    evict(shards)
    result["sparrow_cold"] = sparrow_load(args.sparrow, args.dir, "auto")
    print("sparrow, cold:", {k: v for k, v in result["sparrow_cold"].items() if k != "stderr_tail"}, flush=True)
    result["sparrow_warm"] = sparrow_load(args.sparrow, args.dir, "auto")
    print("sparrow, warm:", {k: v for k, v in result["sparrow_warm"].items() if k != "stderr_tail"}, flush=True)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    result.update(gpu=gpu.stdout.strip(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  disk=subprocess.run(["df", "-h", str(args.dir)], capture_output=True, text=True).stdout)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
