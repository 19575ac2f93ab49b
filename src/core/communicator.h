// The collectives sharded code is written against: one interface, one backend per device
// (src/distributed: gloo over TCP for host memory, NCCL for CUDA memory). Ranks 0 .. size()-1 of a group
// call the same collectives in the same order, each with buffers on the communicator's device; every call
// returns when this rank's part is done (on a GPU: when it is ordered on the kernels' stream).
//
// It sits in core, as an interface only, so that the ops the model is written in (kernels/ops.h) and the
// model itself can take a communicator without including any backend (docs/ARCHITECTURE.md).
//
// Errors: a peer that died or stopped answering within the group's timeout makes the collective throw
// sparrow::Error naming the rank and the operation; the group is unusable afterwards (a sharded step
// cannot be resumed without the dead rank), and its owner ends the process with that message.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "core/tensor.h"

namespace sparrow {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;
  // The backend and transport, for logs: "gloo/tcp", "nccl".
  virtual std::string backend() const = 0;

  // Element types the reductions accept: F32, BF16 (summed in fp32 per step on the CPU), I32, I64.
  // `count` counts elements of `type`.

  // data[i] = sum over ranks of data[i], in place.
  virtual void all_reduce(void* data, int64_t count, ScalarType type) = 0;
  // recv[r * count .. (r+1) * count) = rank r's send[0 .. count).
  virtual void all_gather(const void* send, void* recv, int64_t count, ScalarType type) = 0;
  // recv[0 .. count) = sum over ranks r of rank r's send[rank() * count .. (rank()+1) * count).
  virtual void reduce_scatter(const void* send, void* recv, int64_t count, ScalarType type) = 0;
  // recv[r * count .. (r+1) * count) = rank r's send[rank() * count .. (rank()+1) * count).
  virtual void all_to_all(const void* send, void* recv, int64_t count, ScalarType type) = 0;
  // Every rank's data[0 .. bytes) becomes rank `root`'s.
  virtual void broadcast(void* data, int64_t bytes, int root) = 0;
  // Point to point: `bytes` bytes to / from rank `peer`; each send is matched by the peer's recv of the
  // same size, in order.
  virtual void send(const void* data, int64_t bytes, int peer) = 0;
  virtual void recv(void* data, int64_t bytes, int peer) = 0;
  // Returns when every rank has called it.
  virtual void barrier() = 0;
};

// A rank's place in its tensor-parallel group (docs/parallel.md): the model's blocks keep their part of
// each split weight and reduce or gather through `comm`. size 1 (the default) is the unsharded model, with
// no communicator.
struct TensorParallel {
  int rank = 0, size = 1;
  Communicator* comm = nullptr;
  // --enable-expert-parallel: the routed experts are not split inside but dealt out whole, size / num_experts
  // to a rank (vLLM's EP over the TP group); attention and the shared experts stay tensor parallel.
  bool expert_parallel = false;
  // --data-parallel-size (docs/parallel.md, "Data parallelism"): `dp_size` groups of `size` ranks, each
  // group running its own requests with its own attention and cache, while the routed experts are shared
  // by all of them: split over all dp_size * size ranks (whole under expert_parallel, else inside each
  // expert, as vLLM flattens the experts' tensor parallelism over DP x TP). `dp_comm` joins this rank
  // with the ranks of the same tensor-parallel rank in the other groups: a MoE layer gathers their tokens
  // through it and scatters the sums back (ops::all_gather_rows, ops::reduce_scatter_rows).
  int dp_rank = 0, dp_size = 1;
  Communicator* dp_comm = nullptr;
  // --decode-context-parallel-size (docs/parallel.md, "Decode context parallelism"): the group's ranks
  // dcp_size at a time (consecutive tensor-parallel ranks) share out the tokens of the MLA latents and DSA
  // index keys, token j on dcp rank j mod dcp_size; `dcp_comm` joins them (null when dcp_size is 1).
  int dcp_rank = 0, dcp_size = 1;
  Communicator* dcp_comm = nullptr;
  // MSA's indexer decode context parallelism (--attention-config '{"indexer_decode_cp": true}', the second
  // seed article's): every rank of the group scores every index head over its share of the key blocks, and
  // each head's owner merges the ranks' best blocks (model/msa_indexer.h).
  bool indexer_decode_cp = false;
  // Token-sharded prefill (model/context_parallel.h): a step of at least this many rows runs the MLA layers'
  // attention core (the DSA indexer's scoring and the sparse attention) on a 1 / size share of its rows for
  // every head, between two all-to-alls, instead of on every row for this rank's heads. 0: never.
  int64_t token_sharded_prefill_rows = 0;
  bool sharded() const { return size > 1; }
  bool context_parallel() const { return dcp_size > 1; }
  bool data_parallel() const { return dp_size > 1; }
  // This rank's place among the routed experts' ranks (every rank of every data-parallel group).
  TensorParallel experts_group() const {
    return {dp_rank * size + rank, dp_size * size, nullptr, expert_parallel};
  }
};

}  // namespace sparrow
