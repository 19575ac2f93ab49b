// Speculative decoding's "dspark" method (engine/speculative.h): the DSpark drafter (model/dspark.h) drafts a
// block of k tokens per sequence in one pass. After every target step it writes the context rows of the
// step's kept positions from the target's captured streams; for a sequence whose every token but the newest
// has them, propose() runs the block [newest, mask x (k-1)] for all such sequences at once and draws the
// drafts left to right through the Markov head: its argmax, or (draft_sample_method "probabilistic", for
// requests that sample) a draw from its distribution kept for verification (Sequence::draft_probs).
#pragma once
#include <memory>

#include "engine/speculative.h"

namespace sparrow {

class DSparkDrafter;

std::unique_ptr<DraftProposer> make_dspark_proposer(DSparkDrafter& drafter, bool probabilistic);

}  // namespace sparrow
