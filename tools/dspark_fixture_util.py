"""What the two DSpark fixture tools share (make_dspark_fixture.py: Kimi K3's MLA drafter;
make_qwen3_dspark_fixture.py: the Qwen3 drafter MiniMax-M3.1 is served with): random bf16 weights drawn in a fixed
order from one generator, and the printed self-checks of the references."""
from __future__ import annotations

import math

import torch

F64 = torch.float64


class RandomWeights:
    """bf16 weights by checkpoint name (`out`), drawn in call order from one generator seeded with `seed`: matrices
    N(0, 1/fan_in), norm weights 1 + N(0, 0.1^2), the Markov head N(0, 0.5^2)."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.out: dict[str, torch.Tensor] = {}

    def normal(self, shape, std: float, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=self.generator, dtype=F64) * std + mean).to(torch.bfloat16)

    def mat(self, name: str, rows: int, cols: int):
        self.out[name] = self.normal((rows, cols), 1 / math.sqrt(cols))

    def norm(self, name: str, n: int):
        self.out[name] = self.normal((n,), 0.1, 1.0)

    def mlp_and_norms(self, layer: int, hidden: int, intermediate: int):
        """Layer `layer`'s SiLU MLP and its two RMSNorms, after its attention."""
        p = f"layers.{layer}."
        self.mat(p + "mlp.gate_proj.weight", intermediate, hidden)
        self.mat(p + "mlp.up_proj.weight", intermediate, hidden)
        self.mat(p + "mlp.down_proj.weight", hidden, intermediate)
        self.norm(p + "input_layernorm.weight", hidden)
        self.norm(p + "post_attention_layernorm.weight", hidden)

    def markov_head(self, vocab: int, draft_vocab: int, rank: int):
        """markov_w1 [vocab, rank] (indexed by target ids), markov_w2 [draft_vocab, rank]."""
        self.out["markov_head.markov_w1.weight"] = self.normal((vocab, rank), 0.5)
        self.out["markov_head.markov_w2.weight"] = self.normal((draft_vocab, rank), 0.5)


def check_close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-10) -> float:
    """Prints one self-check of a reference and stops the tool when it fails; returns the largest difference."""
    err = (got - want).abs().max().item()
    print(f"  [{'PASS' if err <= tol else 'FAIL'}] {what}: max |diff| {err:.2e} (tol {tol:.0e})")
    if err > tol:
        raise SystemExit(f"self-check failed: {what}")
    return err
