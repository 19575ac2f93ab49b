// Speculative decoding's "draft_model" method (engine/speculative.h): a smaller model with the target's
// vocabulary proposes k tokens, each sequence in a cache of its own beside the target's: its argmax, or
// (`probabilistic`, for requests that sample) a draw from its distribution at the request's temperature, kept
// with the draft for verification (Sequence::draft_probs).
#pragma once
#include <memory>

#include "engine/speculative.h"

namespace sparrow {

class Model;

// Throws sparrow::Error when the model cannot draft: recurrent layers (their state cannot be set back to
// the tokens the target accepted).
std::unique_ptr<DraftProposer> make_draft_model_proposer(Model& draft, bool probabilistic, bool enforce_eager = false);

}  // namespace sparrow
