// Speculative decoding's "dspark" method (engine/speculative.h): the DSpark drafter (model/dspark.h) drafts a
// block of k tokens per sequence in one pass. After every target step it writes the context rows of the
// step's kept positions from the target's captured streams; for a sequence whose every token but the newest
// has them, propose() runs the block [newest, mask x (k-1)] for all such sequences at once and draws the
// drafts left to right through the Markov head: its argmax, or (draft_sample_method "probabilistic", for
// requests that sample) a draw from its distribution kept for verification (Sequence::draft_probs). With a
// draft top-k (`draft_topk`, else the drafter config's dspark_draft_topk; Qwen3 drafters only, as vLLM
// allows it) the Markov head corrects only each query's top-k base logits and every other id is -inf (vLLM's
// DSparkSpeculator._sample_sequential_topk).
#pragma once
#include <memory>

#include "engine/speculative.h"

namespace sparrow {

class DSparkDrafter;

std::unique_ptr<DraftProposer> make_dspark_proposer(DSparkDrafter& drafter, bool probabilistic,
                                                    int64_t draft_topk = 0);

}  // namespace sparrow
