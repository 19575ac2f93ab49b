"""A random PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) over the attention and MLP
projections of a model folder's layers, the targets sparrow adapts (model/lora.h): for the LoRA tests of the
server and the Python API, and to try --enable-lora on any checkpoint without training one.

    python3 tools/random_lora_adapter.py MODEL_DIR OUT_DIR [--rank 8] [--seed 0] [--scale 0.3] [--routed-experts]

Plain Python (the tests that use it run where numpy may be missing): shapes come from the checkpoint's
safetensors headers (no tensor is read) and the adapter is written as safetensors by hand (F32)."""
from __future__ import annotations

import argparse
import array
import json
import math
import random
import struct
from pathlib import Path

# The projections sparrow adapts (model/lora.h lora_supported_module) but the routed experts (adapted on
# the CPU backend only and not under -dp, so left out here unless asked for: the server tests run both);
# the indexers' too; not the routers.
LEAVES = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "k_proj", "v_proj", "f_a_proj",
          "f_b_proj", "b_proj", "g_proj", "g_a_proj", "g_b_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj", "kv_b_proj",
          "wq_b", "wk", "weights_proj", "index_q_proj", "index_k_proj")


def checkpoint_shapes(model_dir: Path) -> dict[str, list[int]]:
    """{tensor name: shape} from the headers of model_dir's safetensors files."""
    shapes = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj", "w1", "w3", "w2")


def targets(model_dir: Path, routed_experts: bool = False) -> dict[str, list[int]]:
    """{module: [out, in]} of the projections an adapter may target (the MTP layers left out); with
    `routed_experts` each routed expert's too, by expert also where the checkpoint stacks them
    (gate_up_proj [E, 2I, H] holds gate_proj and up_proj, down_proj [E, H, I] down_proj)."""
    out = {}
    for name, shape in checkpoint_shapes(model_dir).items():
        module = name.removesuffix(".weight")
        if ".layers." not in name or "mtp" in name:
            continue
        leaf = module.rsplit(".", 1)[-1]
        if len(shape) == 2 and name.endswith(".weight") and ".experts." not in name and leaf in LEAVES:
            out[module] = shape
        elif routed_experts and len(shape) == 2 and ".experts." in name and leaf in EXPERT_LEAVES:
            out[module] = shape
        elif routed_experts and len(shape) == 3 and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            stack = name.rsplit(".", 1)[0]
            for e in range(shape[0]):
                if name.endswith("gate_up_proj"):
                    out[f"{stack}.{e}.gate_proj"] = out[f"{stack}.{e}.up_proj"] = [shape[1] // 2, shape[2]]
                else:
                    out[f"{stack}.{e}.down_proj"] = [shape[1], shape[2]]
    return out


def write_safetensors(path: Path, tensors: dict[str, tuple[list[int], array.array]]) -> None:
    """{name: (shape, float32 array)} as a safetensors file: 8-byte header length, JSON header, data."""
    header, offset = {}, 0
    for name, (shape, values) in tensors.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * len(values)]}
        offset += 4 * len(values)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, values in tensors.values():
            f.write(values.tobytes())  # little-endian on x86-64 and aarch64


def make_adapter(model_dir: Path, out: Path, rank: int = 8, seed: int = 0, scale: float = 0.3,
                 extra: dict | None = None, routed_experts: bool = False) -> Path:
    """Writes the adapter to `out`: A ~ N(0, 1/in), B ~ scale N(0, 1/r), lora_alpha 2r (scaling 2)."""
    rng = random.Random(seed)

    def normal(count: int, std: float) -> array.array:
        return array.array("f", (rng.gauss(0.0, std) for _ in range(count)))
    tensors = {}
    chosen = targets(model_dir, routed_experts)
    for module, (rows, cols) in chosen.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = ([rank, cols], normal(rank * cols, 1 / math.sqrt(cols)))
        tensors[f"base_model.model.{module}.lora_B.weight"] = ([rows, rank], normal(rows * rank, scale / math.sqrt(rank)))
    if not tensors:
        raise SystemExit(f"{model_dir}: no projection to adapt")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "adapter_model.safetensors", tensors)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": sorted({m.rsplit(".", 1)[-1] for m in chosen})}
    config.update(extra or {})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=0.3)
    parser.add_argument("--routed-experts", action="store_true", help="each routed expert's projections too")
    args = parser.parse_args()
    make_adapter(args.model_dir, args.out_dir, args.rank, args.seed, args.scale, routed_experts=args.routed_experts)
    print(f"wrote {args.out_dir}: {len(targets(args.model_dir, args.routed_experts))} modules, rank {args.rank}")


if __name__ == "__main__":
    main()
