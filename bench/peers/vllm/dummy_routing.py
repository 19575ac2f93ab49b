#!/usr/bin/env python3
"""How many distinct experts a decode batch touches under vLLM's `--load-format dummy`, against uniform routing.

vLLM's dummy loader (vllm/model_executor/model_loader/weight_utils.py, initialize_dummy_weights) draws every
floating-point parameter uniform in [-1e-3, 1e-3]: the RMSNorm weight in front of the router, the router
itself and the router's e_score_correction_bias alike. The three families route by sigmoid scores plus that
bias (DeepSeek-V3.2 and Kimi with expert groups), so the scores move by ~1e-5 from token to token
(normalised hidden state x norm weight 1e-3, summed over the hidden size against router weights of 1e-3,
times sigmoid's slope 1/4) while the bias separates the experts by ~1e-3: the bias decides, and nearly every
token gets the same experts. This draws that model (hidden states unit-RMS Gaussian before the norm) and counts
the distinct experts of a batch, beside the expectation under uniform routing, E (1 - (1 - k/E)^B), which
sparrow's roofline assumes (src/bench/roofline.cpp). bench/sweep.sh therefore runs vLLM with its routing
simulation (VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random); bench/results/serve.md has the measured
consequence.

  python3 bench/peers/vllm/dummy_routing.py [--trials 20]
"""
import argparse

import numpy as np

# name, hidden size, routed experts, top-k, expert groups, groups kept (bench/shapes/serve/*.json)
SHAPES = [("minimax_m3.1_flash", 6144, 128, 4, 1, 1), ("deepseek_v3.2", 7168, 256, 8, 8, 4),
          ("kimi_linear_48b", 2304, 256, 8, 1, 1)]
BATCHES = (1, 4, 16, 64, 256)


def distinct_experts(rng, hidden, experts, top_k, groups, groups_kept, batch, low=-1e-3, high=1e-3):
    norm = rng.uniform(low, high, hidden)               # the RMSNorm weight before the router
    router = rng.uniform(low, high, (experts, hidden))
    bias = rng.uniform(low, high, experts)              # e_score_correction_bias: chooses, does not weigh
    x = rng.standard_normal((batch, hidden)) * norm     # normalised hidden states times the norm weight
    choice = 1 / (1 + np.exp(-(x @ router.T))) + bias
    if groups > 1:  # a group scores the sum of its two best; the best groups_kept groups stay
        best_two = np.sort(choice.reshape(batch, groups, -1), axis=2)[:, :, -2:].sum(axis=2)
        kept = np.argsort(-best_two, axis=1)[:, :groups_kept]
        mask = np.full((batch, groups), -np.inf)
        np.put_along_axis(mask, kept, 0.0, axis=1)
        choice = choice + np.repeat(mask, experts // groups, axis=1)
    chosen = np.argsort(-choice, axis=1)[:, :top_k]
    return len(np.unique(chosen))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="random draws of the weights per batch size")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    print("| shape | batch | distinct experts, vLLM dummy weights | uniform routing |")
    print("|---|---|---|---|")
    for name, hidden, experts, top_k, groups, kept in SHAPES:
        for batch in BATCHES:
            dummy = np.mean([distinct_experts(rng, hidden, experts, top_k, groups, kept, batch)
                             for _ in range(args.trials)])
            uniform = experts * (1 - (1 - top_k / experts) ** batch)
            print(f"| {name} | {batch} | {dummy:.1f} | {uniform:.1f} |")


if __name__ == "__main__":
    main()
