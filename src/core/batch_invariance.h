// Batch-invariant mode (issue 29; vLLM's VLLM_BATCH_INVARIANT=1; docs/engine.md, "Batch invariance").
//
// On the CPU every reduction of a forward pass already has one order whatever the batch, so the mode
// changes nothing there. On the GPU the launchers otherwise choose by the size of the step (cuBLASLt's
// algorithm and split-K, attention's split of the keys, the MoE path, the indexers' kernels, KDA's chunked
// prefill), which moves a row's rounding with its batch. In this mode each of them makes the one choice
// that depends on the row alone, so a request's logits are bitwise the same alone, in any batch, in
// chunked prefill, after a prefix-cache hit, and when its sampled sequence is scored afterwards.
//
// One process-wide setting, read by the kernel launchers at each call: `--batch-invariant` sets it, and
// without that flag it starts from the environment (VLLM_BATCH_INVARIANT=1, as vLLM reads it).
#pragma once

namespace sparrow {

bool batch_invariant();
void set_batch_invariant(bool on);

}  // namespace sparrow
