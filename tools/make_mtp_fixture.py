#!/usr/bin/env python3
"""Builds the MTP drafter's fixtures: a fixture model with a multi-token-prediction layer, and what an MTP
drafter computes for its prompts, from an independent reference.

  deepseek_v32 -> tests/fixtures/deepseek_v32_mtp   (vLLM 0.33 models/deepseek_v32/nvidia/mtp.py,
                                                      model_executor/models/deepseek_mtp.py)
  minimax_m3   -> tests/fixtures/minimax_m3_mtp     (vLLM 0.33 models/minimax_m3/nvidia/mtp.py)

The layer is random from a seed and stored in bfloat16 like the fixture's other weights, under the names the
releases use: DeepSeek-V3.2 model.layers.{L}.* (enorm, hnorm, eh_proj, shared_head.norm, shared_head.head,
its own embed_tokens copy and a whole MoE decoder layer); MiniMax-M3 model.mtp.layers.0.* (enorm, hnorm,
eh_proj, final_layernorm, and the decoder layer, forced to MSA and the MoE, under transformer_layer.; the
embedding and lm_head are the model's).

The reference runs transformers 5.17's modules of the family (float32, eager attention, as
tools/make_fixtures.py computes the fixtures) for the decoder layers, and the MTP glue in float64:
  h_p    = the target's hidden state after its final norm (both vLLM models return it normed)
  x_p    = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)]), the embedding zeroed at position 0 (RMSNorm
           x^ * w for DeepSeek, Gemma's x^ * (1 + w) for MiniMax)
  x      = the decoder layer over x_0 .. x_p, residual form
  logits = head(norm(x))            (DeepSeek: shared_head; MiniMax: final_layernorm and the model's lm_head)
For a prompt t_0 .. t_{n-1} the target's greedy next token is t_n; the first draft is the argmax of the MTP
logits at position n - 1, each further draft the argmax after one more position whose input is the last
draft and, as h, the layer's own state at the position before: after the norm for DeepSeek (vLLM 0.33
recycles the post-norm state), before it for MiniMax (its layer returns the state before final_layernorm).

Writes into --out: config.json, generation_config.json, prompts.json (the fixture's), model.safetensors (its
tensors and the MTP layer), mtp.json {"next": [t_n per prompt], "drafts": [[K drafts] per prompt],
"min_gap": ...}, mtp_reference.safetensors float32 `mtp_logits.<i>` [len_i, vocab] (the MTP logits at every
prompt position, position p taking t_{p+1}, the last t_n). A seed whose drafts or next tokens are decided by
less than --min-gap (relative to the row's largest logit) is rejected for the next.

Usage: python3 tools/make_mtp_fixture.py --family deepseek_v32 --out tests/fixtures/deepseek_v32_mtp
       python3 tools/make_mtp_fixture.py --family minimax_m3 --out tests/fixtures/minimax_m3_mtp
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

DRAFTS = 3
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Family:
    model: type
    config: type
    sparse_type: str          # the layer type of a sparse-attention layer
    gemma: bool               # RMSNorm x^ * (1 + w) (MiniMax) or x^ * w
    mtp_prefix: str           # where the MTP tensors live ({L}: the model's layer count)
    block_prefix: str         # where its decoder layer's tensors live
    final_norm: str           # the MTP's output norm, under mtp_prefix
    own_head: str | None      # the MTP's own head under mtp_prefix, else the model's lm_head
    own_embed: bool           # the MTP layer holds a copy of the embedding (DeepSeek's checkpoints do)
    recycles_normed: bool     # the state handed to the next draft step is after the output norm


FAMILIES = {
    "deepseek_v32": Family(DeepseekV32ForCausalLM, DeepseekV32Config, "deepseek_sparse_attention", False,
                           "model.layers.{L}.", "model.layers.{L}.", "shared_head.norm.weight", "shared_head.head.weight",
                           True, True),
    "minimax_m3": Family(MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig, "minimax_m3_sparse", True,
                         "model.mtp.layers.0.", "model.mtp.layers.0.transformer_layer.", "final_layernorm.weight", None,
                         False, False),
}


def norm_weight(family: Family, n: int, g: torch.Generator) -> torch.Tensor:
    noise = 0.2 * torch.randn(n, generator=g)
    return (noise if family.gemma else 1 + noise).to(torch.bfloat16)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * ((1 + w) if gemma else w)


def family_config(family: Family, source: Path, **changes):
    config = family.config.from_pretrained(source)
    for key, value in changes.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    return config


def random_mtp_layer(family: Family, source: Path, config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The MTP tensors: the decoder layer as transformers writes layer L of a random checkpoint (so its names
    are the on-disk ones), moved under block_prefix, and the glue."""
    L = config["num_hidden_layers"]
    torch.manual_seed(seed)
    cfg = family_config(family, source, num_hidden_layers=L + 1, layer_types=config["layer_types"] + [family.sparse_type],
                        mlp_layer_types=config["mlp_layer_types"] + ["sparse"])
    model = family.model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(f"model.layers.{L}.") and p.dim() == 1 and "bias" not in name:
                # norms other than their initial values: a mixed-up norm shows
                noise = 0.2 * torch.randn_like(p)
                p.add_(noise) if family.gemma else p.mul_(1 + noise)
            if "e_score_correction_bias" in name:
                p.copy_(0.01 * torch.randn_like(p))
    tensors = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        with safe_open(str(Path(tmp) / "model.safetensors"), "pt") as f:
            for key in f.keys():
                if key.startswith(f"model.layers.{L}."):
                    tensors[family.block_prefix.format(L=L) + key[len(f"model.layers.{L}."):]] = f.get_tensor(key)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    prefix = family.mtp_prefix.format(L=L)
    g = torch.Generator().manual_seed(seed + 1000)
    tensors[prefix + "enorm.weight"] = norm_weight(family, hidden, g)
    tensors[prefix + "hnorm.weight"] = norm_weight(family, hidden, g)
    tensors[prefix + "eh_proj.weight"] = (0.08 * torch.randn(hidden, 2 * hidden, generator=g)).to(torch.bfloat16)
    tensors[prefix + family.final_norm] = norm_weight(family, hidden, g)
    if family.own_head:
        tensors[prefix + family.own_head] = (0.05 * torch.randn(vocab, hidden, generator=g)).to(torch.bfloat16)
    return tensors


class Reference:
    def __init__(self, family: Family, folder: Path, config: dict):
        self.family = family
        self.eps = config["rms_norm_eps"]
        L = config["num_hidden_layers"]
        self.target = family.model.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
        prefix, block = family.mtp_prefix.format(L=L), family.block_prefix.format(L=L)
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            weights = {k: f.get_tensor(k) for k in f.keys()}
        glue = lambda name: weights[prefix + name].to(torch.float64)  # noqa: E731
        self.embed = glue("embed_tokens.weight") if family.own_embed else weights["model.embed_tokens.weight"].double()
        self.enorm, self.hnorm, self.eh_proj = glue("enorm.weight"), glue("hnorm.weight"), glue("eh_proj.weight")
        # The layer itself, as a one-layer model of the family whose final norm and head are the MTP's.
        glue_names = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "final_layernorm.", "embed_tokens.")
        state = {"model.layers.0." + k[len(block):]: v for k, v in weights.items()
                 if k.startswith(block) and not k[len(block):].startswith(glue_names)}
        state["model.norm.weight"] = weights[prefix + family.final_norm]
        state["lm_head.weight"] = weights[prefix + family.own_head] if family.own_head else weights["lm_head.weight"]
        state["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"]
        with tempfile.TemporaryDirectory() as tmp:
            save_file(state, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            family_config(family, folder, num_hidden_layers=1, layer_types=[family.sparse_type],
                          mlp_layer_types=["sparse"], first_k_dense_replace=0).save_pretrained(tmp)
            self.mtp = family.model.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()
        self.state = None  # the state the next draft step reads
        if family.recycles_normed:
            self.mtp.model.norm.register_forward_hook(lambda m, args, out: setattr(self, "state", out))
        else:
            self.mtp.model.layers[0].register_forward_hook(
                lambda m, args, out: setattr(self, "state", out[0] if isinstance(out, tuple) else out))
        self.final = None
        self.target.model.norm.register_forward_hook(lambda m, args, out: setattr(self, "final", out))

    @torch.no_grad()
    def target_pass(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.target(torch.tensor([ids])).logits[0]
        return logits.double(), self.final[0].double()

    @torch.no_grad()
    def mtp_pass(self, next_tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gemma = self.family.gemma
        e = self.embed[torch.tensor(next_tokens)].clone()
        e[0] = 0  # position 0
        x = torch.cat([rms(e, self.enorm, self.eps, gemma), rms(hidden, self.hnorm, self.eps, gemma)], dim=-1) @ self.eh_proj.T
        logits = self.mtp(inputs_embeds=x[None].to(torch.float32)).logits[0]
        return logits.double(), self.state[0].double()


def gap(row: torch.Tensor) -> float:
    top = torch.topk(row, 2).values
    return float((top[0] - top[1]) / row.abs().max())


def build(family: Family, source: Path, out: Path, seed: int) -> dict:
    config = json.loads((source / "config.json").read_text())
    L = config["num_hidden_layers"]
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        for key in f.keys():
            tensors[key] = f.get_tensor(key)
    mtp = random_mtp_layer(family, source, config, seed)
    if family.own_embed:
        mtp[family.mtp_prefix.format(L=L) + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors.update(mtp)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if family.mtp_prefix.startswith("model.mtp."):
        config["num_mtp_modules"] = 1
    else:
        config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in ("prompts.json", "generation_config.json"):
        shutil.copy(source / name, out / name)

    ref = Reference(family, out, config)
    prompts = json.loads((source / "prompts.json").read_text())["prompts"]
    result = {"next": [], "drafts": [], "min_gap": 1.0, "seed": seed, "drafts_per_prompt": DRAFTS}
    logits_out = {}
    for i, ids in enumerate(prompts):
        logits, hidden = ref.target_pass(ids)
        result["min_gap"] = min(result["min_gap"], gap(logits[-1]))
        next_token = int(logits[-1].argmax())
        tokens = ids[1:] + [next_token]
        mtp_logits, states = ref.mtp_pass(tokens, hidden)
        logits_out[f"mtp_logits.{i}"] = mtp_logits.to(torch.float32).contiguous()
        drafts = []
        rows = hidden
        for _ in range(DRAFTS):
            last = mtp_logits[-1]
            result["min_gap"] = min(result["min_gap"], gap(last))
            drafts.append(int(last.argmax()))
            # One more position: the draft, with the layer's own state at the position before.
            tokens = tokens + [drafts[-1]]
            rows = torch.cat([rows, states[-1:]], dim=0)
            mtp_logits, states = ref.mtp_pass(tokens, rows)
        result["next"].append(next_token)
        result["drafts"].append(drafts)
    save_file(logits_out, str(out / "mtp_reference.safetensors"))
    (out / "mtp.json").write_text(json.dumps(result) + "\n")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="deepseek_v32")
    parser.add_argument("--source", type=Path, help="the fixture to extend (default tests/fixtures/<family>)")
    parser.add_argument("--out", type=Path, help="default tests/fixtures/<family>_mtp")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--min-gap", type=float, default=3e-5)
    args = parser.parse_args()
    source = args.source or REPO / "tests" / "fixtures" / args.family
    out = args.out or REPO / "tests" / "fixtures" / f"{args.family}_mtp"
    for seed in range(args.seed, args.seed + 30):
        result = build(FAMILIES[args.family], source, out, seed)
        if result["min_gap"] >= args.min_gap:
            print(json.dumps(result))
            return
        print(f"seed {seed}: a decision gap of {result['min_gap']:.2e}; next seed")
    raise SystemExit("no seed gave decisions clear of rounding")


if __name__ == "__main__":
    main()
