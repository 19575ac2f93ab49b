#!/usr/bin/env python3
"""Trains the multi-token-prediction layer of a bundled model (models/<family>), so that speculative decoding's
"mtp" method (docs/speculative.md) has a drafter whose acceptance is real end to end.

The target stays frozen. The layer is what tools/make_mtp_fixture.py describes and sparrow loads (the names the
releases use; vLLM 0.33 models/deepseek_v32/nvidia/mtp.py, models/minimax_m3/nvidia/mtp.py):
  x_p    = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])   h_p: the target's state after its final norm,
                                                            the embedding zeroed at position 0
  x      = one decoder layer of the family over x_0 .. x_p (DSA or MSA attention, MoE)
  logits = head(norm(x))                                   DeepSeek: its own shared_head (initialised from
                                                            the model's lm_head); MiniMax: the model's lm_head
trained to predict t_{p+2} with cross-entropy (DeepSeek-V3 technical report §2.2, its MTP loss), on windows of
the bundled model's own training sources (the standard library's code and tools/chat_corpus.py's
conversations, tokenized with the bundled tokenizer); the layer's indexer learns from its attention as the
model's did (train_small_models.IndexerDistillation), its router balances as the model's did (RouterBalancer).

The layer is added to the folder's model.safetensors (bf16) and config.json gets num_nextn_predict_layers = 1
(DeepSeek) or num_mtp_modules = 1 (MiniMax); the model's own tensors are untouched. Kimi K3's MTP layer (MLA
with the latent MoE, tools/kimi_k3_torch.py) is not trained here.

Usage: python3 tools/train_mtp_drafter.py --family deepseek_v32 [--minutes 10] [--folder models/deepseek_v32]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import make_mtp_fixture as mtp_fixture  # noqa: E402
import train_small_models as small  # noqa: E402


def corpus_for(folder: Path, family: str, args) -> small.Corpus:
    """The bundled model's training sources, tokenized with its own tokenizer (no new vocabulary)."""
    code, chats = small.training_texts(small.FAMILIES[family], small.TEMPLATES, args.seed, args.code_megabytes,
                                       args.conversations)
    return small.encode_corpus(Tokenizer.from_file(str(folder / "tokenizer.json")), code, chats)[0]


class Drafter(torch.nn.Module):
    """The MTP layer in training: the glue and a one-layer model of the family (its norm and head the MTP's)."""

    def __init__(self, family: mtp_fixture.Family, folder: Path, target, seed: int):
        super().__init__()
        self.family = family
        config = json.loads((folder / "config.json").read_text())
        self.eps = config["rms_norm_eps"]
        hidden = config["hidden_size"]
        torch.manual_seed(seed)
        cfg = mtp_fixture.family_config(family, folder, num_hidden_layers=1, layer_types=[family.sparse_type],
                                        mlp_layer_types=["sparse"], first_k_dense_replace=0)
        self.layer = family.model(cfg)
        with torch.no_grad():
            self.layer.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            self.layer.lm_head.weight.copy_(target.lm_head.weight)
        self.layer.model.embed_tokens.weight.requires_grad_(False)
        self.layer.lm_head.weight.requires_grad_(family.own_head is not None)  # MiniMax shares the model's
        init = torch.zeros(hidden) if family.gemma else torch.ones(hidden)
        self.enorm = torch.nn.Parameter(init.clone())
        self.hnorm = torch.nn.Parameter(init.clone())
        self.eh_proj = torch.nn.Parameter(torch.randn(hidden, 2 * hidden) * (2 * hidden) ** -0.5)

    def forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e = self.layer.model.embed_tokens(next_tokens)
        e = torch.cat([torch.zeros_like(e[:, :1]), e[:, 1:]], dim=1)  # position 0
        x = torch.cat([mtp_fixture.rms(e, self.enorm, self.eps, self.family.gemma),
                       mtp_fixture.rms(hidden, self.hnorm, self.eps, self.family.gemma)], dim=-1) @ self.eh_proj.T
        return self.layer(inputs_embeds=x).logits

    def tensors(self, L: int) -> dict[str, torch.Tensor]:
        """The layer under the names the releases use (make_mtp_fixture.random_mtp_layer writes the same)."""
        family = self.family
        prefix, block = family.mtp_prefix.format(L=L), family.block_prefix.format(L=L)
        out = {}
        with tempfile.TemporaryDirectory() as tmp:
            self.layer.to(torch.bfloat16).save_pretrained(tmp)
            self.layer.to(torch.float32)
            with safe_open(str(Path(tmp) / "model.safetensors"), "pt") as f:
                for key in f.keys():
                    if key.startswith("model.layers.0."):
                        out[block + key[len("model.layers.0."):]] = f.get_tensor(key)
        out[prefix + "enorm.weight"] = self.enorm.detach().to(torch.bfloat16)
        out[prefix + "hnorm.weight"] = self.hnorm.detach().to(torch.bfloat16)
        out[prefix + "eh_proj.weight"] = self.eh_proj.detach().to(torch.bfloat16).contiguous()
        out[prefix + family.final_norm] = self.layer.model.norm.weight.detach().to(torch.bfloat16)
        if family.own_head:
            out[prefix + family.own_head] = self.layer.lm_head.weight.detach().to(torch.bfloat16).contiguous()
        # DeepSeek's releases also hold a copy of the embedding in the layer; sparrow falls back to the model's
        # (model/mtp.h), so the bundled folder skips the copy (1.5 MB).
        return out


def train(drafter: Drafter, target, corpus: small.Corpus, args) -> dict:
    final = {}
    target.model.norm.register_forward_hook(lambda m, a, out: final.__setitem__("h", out))
    indexers = small.IndexerDistillation(drafter.layer)
    balancer = small.RouterBalancer(drafter.layer, small.BIAS_UPDATE_RATE)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    start = last = time.time()
    steps, losses, history = 0, [], []
    drafter.train()
    while True:
        progress = (time.time() - start) / (args.minutes * 60.0)
        if progress >= 1.0:
            break
        indexers.set_dense(progress < small.DENSE_WARMUP)
        for group in optimizer.param_groups:
            group["lr"] = small.learning_rate(progress, args.lr)
        batch = small.sample_batch(corpus, args.batch_size, args.context, generator)
        with torch.no_grad():
            target(batch)
        # Position p takes (t_{p+1}, h_p) and predicts t_{p+2}.
        logits = drafter(batch[:, 1:], final["h"][:, :-1].detach())
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 2:].reshape(-1))
        indexer = indexers.take_loss()
        total = loss if indexer is None else loss + indexer[0]
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        balancer.update()
        steps += 1
        losses.append(loss.item())
        if time.time() - last >= args.print_every or steps == 1:
            mean = sum(losses[-20:]) / len(losses[-20:])
            history.append((steps, round(mean, 4)))
            print(f"    step {steps:5d}  {time.time() - start:6.1f}s  MTP loss {mean:.3f}", flush=True)
            last = time.time()
    indexers.remove()
    balancer.remove()
    drafter.eval()
    return {"steps": steps, "seconds": round(time.time() - start), "first_loss": round(losses[0], 4),
            "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4), "history": history}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True, choices=sorted(mtp_fixture.FAMILIES))
    parser.add_argument("--folder", type=Path, help="the bundled model (default: models/<family>)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--context", type=int, default=256, help="training window (tokens)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--code-megabytes", type=float, default=4.0)
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--print-every", type=float, default=15.0)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    family = mtp_fixture.FAMILIES[args.family]
    folder = args.folder or ROOT / "models" / args.family
    config = json.loads((folder / "config.json").read_text())
    L = config["num_hidden_layers"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        # The model's own tensors (a layer trained before is replaced).
        tensors = {k: f.get_tensor(k) for k in f.keys()
                   if not k.startswith((family.mtp_prefix.format(L=L), family.block_prefix.format(L=L)))}

    target = family.model.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    target.requires_grad_(False)
    print(f"== {args.family}: corpus", flush=True)
    corpus = corpus_for(folder, args.family, args)
    print(f"  {corpus.code.numel():,} code tokens, {corpus.chats.numel():,} chat tokens", flush=True)
    drafter = Drafter(family, folder, target, args.seed)
    log = train(drafter, target, corpus, args)
    print(f"  trained {log['steps']} steps in {log['seconds']}s: MTP loss {log['first_loss']} -> {log['final_loss']}")

    tensors.update(drafter.tensors(L))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config["num_mtp_modules" if family.mtp_prefix.startswith("model.mtp.") else "num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / "mtp_training.json").write_text(json.dumps(dict(log, minutes=args.minutes, context=args.context,
                                                              batch_size=args.batch_size, lr=args.lr, seed=args.seed),
                                                         indent=2) + "\n")
    print(f"  wrote the MTP layer into {folder}", flush=True)


if __name__ == "__main__":
    main()
