// Speculative decoding's "mtp" method (engine/speculative.h): the checkpoint's multi-token-prediction layer
// (model/mtp.h) drafts from the target's hidden states. After every step it takes the step's new positions
// p (rows the target kept) with the tokens that follow them, (t_{p+1}, h_p), writing its cache rows beside
// the target's; the last of them gives the first draft, and each further draft one more pass of the layer
// on its own output state. Drafts are its argmax.
#pragma once
#include <memory>

#include "engine/speculative.h"

namespace sparrow {

class MtpDrafter;

std::unique_ptr<DraftProposer> make_mtp_proposer(MtpDrafter& drafter, bool enforce_eager = false);

}  // namespace sparrow
