// The communicator for CUDA memory (core/communicator.h): NCCL's collectives on the engine's stream, so that
// a collective is ordered with the kernels around it and a decode step's CUDA graph captures it. The ranks
// find each other through the run's TcpStore: rank 0 makes NCCL's unique id and publishes it there.
//
// One rank per GPU: NCCL before 2.30 refuses two ranks of a communicator on one device, so ranks that share
// a GPU keep the host communicator (gloo) and stage their tensors through the host (ProcessGroup chooses).
// Reductions take F32, BF16 (NCCL sums bf16 in bf16 steps: not bit-equal to the host backend's fp32 sums),
// I32 and I64. A dead peer is not noticed by NCCL itself: the run's supervisor (or launcher) ends the
// ranks, as with torch's NCCL process groups without their watchdog.
#pragma once
#include <memory>
#include <string>

#include "core/communicator.h"

namespace gloo::rendezvous {
class Store;
}

namespace sparrow {

// Whether NCCL can be used: a CUDA build, and libnccl.so.2 found at run time (SPARROW_NCCL_LIBRARY, else the
// loader's search path).
bool nccl_available();

// Rank `rank` of `size` joins the NCCL communicator named `prefix` in `store` on the current CUDA device
// (device::select_for_local_rank first). Throws sparrow::Error with NCCL's message when it cannot.
std::unique_ptr<Communicator> connect_nccl(int rank, int size, std::shared_ptr<gloo::rendezvous::Store> store,
                                           const std::string& prefix);

}  // namespace sparrow
