#include "runner/step_plan.h"

#include <memory>
#include <string>
#include <utility>

#include "core/error.h"
#include "core/wire.h"

namespace sparrow {

using wire::Reader;
using wire::Writer;

std::vector<uint8_t> encode_plan(const StepPlan& plan) {
  Writer w;
  w.put<uint8_t>(uint8_t(plan.kind));
  switch (plan.kind) {
    case StepPlan::Kind::Cache:
      w.put<int32_t>(plan.cache);
      w.put<int64_t>(plan.config.block_size);
      w.put(plan.config.kv_cache_dtype);
      w.put(plan.config.indexer_kv_dtype);
      w.put<int64_t>(plan.config.max_num_seqs);
      w.put<uint8_t>(plan.config.enable_prefix_caching);
      w.put<uint8_t>(plan.config.rollback_snapshots);
      w.put<int64_t>(plan.config.num_blocks);
      break;
    case StepPlan::Kind::DropCache:
    case StepPlan::Kind::DropLora:
      w.put<int32_t>(plan.cache);
      break;
    case StepPlan::Kind::Lora:
      w.put<int32_t>(plan.cache);
      w.put(plan.lora.name);
      w.put(plan.lora.path);
      w.put(plan.lora.base_model);
      w.put<int64_t>(plan.lora.max_rank);
      break;
    case StepPlan::Kind::Step:
      w.put<uint64_t>(plan.state_ops.size());
      for (const StepPlan::StateOp& op : plan.state_ops) {
        w.put<int32_t>(op.cache);
        w.put<int32_t>(op.op.state_slot);
        w.put<int32_t>(op.op.from_snapshot);
      }
      w.put(plan.tokens);
      w.put<uint64_t>(plan.seqs.size());
      for (const StepPlan::Sequence& s : plan.seqs) {
        w.put<int32_t>(s.cache);
        w.put<int64_t>(s.start);
        w.put<int64_t>(s.count);
        w.put<int64_t>(s.logits);
        w.put(s.blocks);
        w.put<int32_t>(s.state_slot);
        w.put<int32_t>(s.snapshot_slot);
        w.put<int64_t>(s.snapshot_position);
        w.put<int32_t>(s.lora);
      }
      w.put<uint8_t>(plan.all_logits);
      w.put(plan.group_tokens);
      w.put(plan.embedded_rows);
      w.put(plan.embedded);
      break;
    case StepPlan::Kind::Idle:
      w.put(plan.group_tokens);
      break;
    case StepPlan::Kind::Stop:
      break;
  }
  return std::move(w.bytes);
}

StepPlan decode_plan(const std::vector<uint8_t>& bytes) {
  Reader r(bytes, "step plan");
  StepPlan plan;
  const uint8_t kind = r.get<uint8_t>();
  SPARROW_CHECK(kind >= uint8_t(StepPlan::Kind::Cache) && kind <= uint8_t(StepPlan::Kind::DropLora),
                "step plan: unknown kind ", int(kind));
  plan.kind = StepPlan::Kind(kind);
  switch (plan.kind) {
    case StepPlan::Kind::Cache:
      plan.cache = r.get<int32_t>();
      plan.config.block_size = r.get<int64_t>();
      plan.config.kv_cache_dtype = r.get_string();
      plan.config.indexer_kv_dtype = r.get_string();
      plan.config.max_num_seqs = r.get<int64_t>();
      plan.config.enable_prefix_caching = r.get<uint8_t>() != 0;
      plan.config.rollback_snapshots = r.get<uint8_t>() != 0;
      plan.config.num_blocks = r.get<int64_t>();
      break;
    case StepPlan::Kind::DropCache:
    case StepPlan::Kind::DropLora:
      plan.cache = r.get<int32_t>();
      break;
    case StepPlan::Kind::Lora:
      plan.cache = r.get<int32_t>();
      plan.lora.name = r.get_string();
      plan.lora.path = r.get_string();
      plan.lora.base_model = r.get_string();
      plan.lora.max_rank = r.get<int64_t>();
      break;
    case StepPlan::Kind::Step: {
      const uint64_t ops = r.get<uint64_t>();
      for (uint64_t i = 0; i < ops; ++i) {
        StepPlan::StateOp op;
        op.cache = r.get<int32_t>();
        op.op.state_slot = r.get<int32_t>();
        op.op.from_snapshot = r.get<int32_t>();
        plan.state_ops.push_back(op);
      }
      plan.tokens = r.get_vector<int32_t>();
      const uint64_t seqs = r.get<uint64_t>();
      int64_t rows = 0;
      for (uint64_t i = 0; i < seqs; ++i) {
        StepPlan::Sequence s;
        s.cache = r.get<int32_t>();
        s.start = r.get<int64_t>();
        s.count = r.get<int64_t>();
        s.logits = r.get<int64_t>();
        s.blocks = r.get_vector<int32_t>();
        s.state_slot = r.get<int32_t>();
        s.snapshot_slot = r.get<int32_t>();
        s.snapshot_position = r.get<int64_t>();
        s.lora = r.get<int32_t>();
        SPARROW_CHECK(s.start >= 0 && s.count > 0, "step plan: sequence ", i, " runs ", s.count, " tokens from ", s.start);
        SPARROW_CHECK(s.logits >= 1 && s.logits <= s.count, "step plan: sequence ", i, " asks for ", s.logits,
                      " rows of logits of ", s.count);
        rows += s.count;
        plan.seqs.push_back(std::move(s));
      }
      SPARROW_CHECK(rows == int64_t(plan.tokens.size()), "step plan: ", plan.tokens.size(), " tokens for ", rows,
                    " sequence rows");
      plan.all_logits = r.get<uint8_t>() != 0;
      plan.group_tokens = r.get_vector<int64_t>();
      plan.embedded_rows = r.get_vector<int64_t>();
      plan.embedded = r.get_vector<float>();
      for (int64_t row : plan.embedded_rows)
        SPARROW_CHECK(row >= 0 && row < rows, "step plan: embedded row ", row, " outside a step of ", rows, " rows");
      SPARROW_CHECK(plan.embedded_rows.empty() ? plan.embedded.empty()
                                               : plan.embedded.size() % plan.embedded_rows.size() == 0 &&
                                                     !plan.embedded.empty(),
                    "step plan: ", plan.embedded.size(), " embedding values for ", plan.embedded_rows.size(), " rows");
      break;
    }
    case StepPlan::Kind::Idle:
      plan.group_tokens = r.get_vector<int64_t>();
      SPARROW_CHECK(!plan.group_tokens.empty(), "step plan: an idle step without the groups' token counts");
      break;
    case StepPlan::Kind::Stop:
      break;
  }
  r.finish();
  return plan;
}

// ---------------------------------------------------------------------------------------------
// Rank 0.

WorkerChannel::WorkerChannel(Communicator& channel) : channel_(channel), alive_(std::make_shared<bool>(true)) {
  SPARROW_CHECK(channel.rank() == 0, "the plan channel's sender is rank 0, not ", channel.rank());
}

WorkerChannel::~WorkerChannel() {
  *alive_ = false;
  try {
    StepPlan stop;
    stop.kind = StepPlan::Kind::Stop;
    send(stop);
  } catch (const Error&) {
    // The workers are gone already: nothing is left to stop.
  }
}

void WorkerChannel::send(const StepPlan& plan) {
  std::vector<uint8_t> bytes = encode_plan(plan);
  int64_t size = int64_t(bytes.size());
  channel_.broadcast(&size, sizeof(size), 0);
  channel_.broadcast(bytes.data(), size, 0);
}

int32_t WorkerChannel::cache_id(KvCache& cache) {
  auto it = caches_.find(cache.uid());
  if (it != caches_.end()) return it->second;
  const int32_t id = next_cache_++;
  caches_[cache.uid()] = id;
  StepPlan plan;
  plan.kind = StepPlan::Kind::Cache;
  plan.cache = id;
  plan.config = cache.config();
  plan.config.num_blocks = cache.plan().num_blocks;
  send(plan);
  // From now on the workers see every state write this cache makes outside a step. Those made before (the
  // zeroed slots of sequences made before its first step) the twin starts with: its slots begin zeroed.
  cache.record_state_ops(true);
  const uint64_t uid = cache.uid();
  cache.on_destroy([this, alive = alive_, uid, id] {
    if (!*alive) return;
    caches_.erase(uid);
    try {
      StepPlan drop;
      drop.kind = StepPlan::Kind::DropCache;
      drop.cache = id;
      send(drop);
    } catch (const Error&) {
      // A dead worker is reported by the next step's collectives (or the supervisor), not from a destructor.
    }
  });
  return id;
}

int32_t WorkerChannel::lora_id(const std::shared_ptr<const LoraAdapter>& adapter) {
  for (auto it = loras_.begin(); it != loras_.end();) {
    if (it->second.expired()) {
      StepPlan drop;
      drop.kind = StepPlan::Kind::DropLora;
      drop.cache = it->first;
      send(drop);
      it = loras_.erase(it);
    } else {
      ++it;
    }
  }
  if (!adapter) return -1;
  for (const auto& [id, held] : loras_)
    if (held.lock() == adapter) return id;
  StepPlan plan;
  plan.kind = StepPlan::Kind::Lora;
  plan.cache = next_lora_++;
  plan.lora = {adapter->name, adapter->path, adapter->base_model, adapter->max_rank};
  send(plan);
  loras_[plan.cache] = adapter;
  return plan.cache;
}

void WorkerChannel::send_step(const Batch& batch) {
  StepPlan plan;
  plan.tokens = batch.tokens;
  plan.all_logits = batch.all_logits;
  std::map<int32_t, KvCache*> stepped;
  for (const SeqSlice& s : batch.seqs) {
    SequenceCache& cache = s.cache();
    KvCache* kv = dynamic_cast<KvCache*>(const_cast<PagedStorage*>(cache.paged()));
    SPARROW_CHECK(kv, "a tensor-parallel model runs sequences in paged caches (KvCache) only");
    StepPlan::Sequence seq;
    seq.cache = cache_id(*kv);
    stepped[seq.cache] = kv;
    seq.start = s.start();
    seq.count = s.count;
    seq.logits = s.logits;
    seq.blocks = cache.block_table();
    seq.state_slot = cache.state_slot_index();
    // The snapshot the step will take (asked now, as the layers will ask: the answer is the same).
    seq.snapshot_position = cache.snapshot_position(s.start(), s.start() + s.count);
    seq.snapshot_slot = seq.snapshot_position >= 0 ? cache.snapshot_slot_index() : -1;
    seq.lora = lora_id(s.state->lora);
    plan.seqs.push_back(std::move(seq));
  }
  for (auto& [id, kv] : stepped)
    for (const KvCache::StateOp& op : kv->take_state_ops()) plan.state_ops.push_back({id, op});
  plan.group_tokens = batch.group_tokens;
  if (!batch.embedded_rows.empty()) {
    SPARROW_CHECK(batch.embedded.defined() && batch.embedded.on_cpu() && batch.embedded.type() == ScalarType::F32 &&
                      batch.embedded.ndim() == 2 && batch.embedded.dim(0) == int64_t(batch.embedded_rows.size()),
                  "a step's embedded rows come as host fp32 [rows, hidden]");
    plan.embedded_rows = batch.embedded_rows;
    plan.embedded.assign(batch.embedded.as<float>(), batch.embedded.as<float>() + batch.embedded.numel());
  }
  send(plan);
}

void WorkerChannel::send_idle(const Batch& batch) {
  StepPlan plan;
  plan.kind = StepPlan::Kind::Idle;
  plan.group_tokens = batch.group_tokens;
  send(plan);
}

// ---------------------------------------------------------------------------------------------
// Workers.

namespace {

StepPlan receive_plan(Communicator& channel) {
  int64_t size = 0;
  channel.broadcast(&size, sizeof(size), 0);
  SPARROW_CHECK(size > 0 && size < (int64_t(1) << 34), "step plan: a message of ", size, " bytes");
  std::vector<uint8_t> bytes(size);
  channel.broadcast(bytes.data(), size, 0);
  return decode_plan(bytes);
}

}  // namespace

void run_worker(Model& model, Communicator& channel, RunnerOptions options) {
  options.workers = nullptr;
  ModelRunner runner(model, options);
  std::map<int32_t, std::unique_ptr<KvCache>> twins;
  std::map<int32_t, std::shared_ptr<const LoraAdapter>> loras;  // rank 0's adapters, this rank's part
  auto twin = [&](int32_t id) -> KvCache& {
    auto it = twins.find(id);
    SPARROW_CHECK(it != twins.end(), "step plan: unknown cache ", id);
    return *it->second;
  };
  for (;;) {
    StepPlan plan = receive_plan(channel);
    switch (plan.kind) {
      case StepPlan::Kind::Stop:
        return;
      case StepPlan::Kind::Cache: {
        SPARROW_CHECK(plan.config.num_blocks > 0, "step plan: cache ", plan.cache, " without a block count");
        plan.config.device = model.device();
        auto cache = std::make_unique<KvCache>(model.cache_spec(), plan.config);
        for (int32_t slot = 0; slot < cache->plan().num_state_slots; ++slot) cache->apply({slot, -1});
        twins[plan.cache] = std::move(cache);
        break;
      }
      case StepPlan::Kind::DropCache:
        twins.erase(plan.cache);
        break;
      case StepPlan::Kind::Lora:
        // Rank 0 read the same folder a moment ago: a failure here (a folder missing on this node) ends the
        // run with its reason rather than serving the adapter on some ranks only.
        loras[plan.cache] = load_lora_adapter(plan.lora.name, plan.lora.path, plan.lora.base_model, model.lora_target(),
                                              plan.lora.max_rank);
        break;
      case StepPlan::Kind::DropLora:
        loras.erase(plan.cache);
        break;
      case StepPlan::Kind::Idle: {
        Batch idle;
        idle.group_tokens = plan.group_tokens;
        model.step_idle(idle);
        break;
      }
      case StepPlan::Kind::Step: {
        for (const StepPlan::StateOp& op : plan.state_ops) twin(op.cache).apply(op.op);
        std::vector<SequenceState> states(plan.seqs.size());
        std::vector<std::pair<KvCache*, SeqId>> mirrors;
        std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
        int64_t row = 0;
        for (size_t i = 0; i < plan.seqs.size(); ++i) {
          const StepPlan::Sequence& s = plan.seqs[i];
          KvCache& cache = twin(s.cache);
          const SeqId id = cache.mirror(s.blocks, s.state_slot, s.snapshot_slot, s.snapshot_position);
          mirrors.emplace_back(&cache, id);
          states[i].length = s.start;
          states[i].cache = cache.view(id);
          if (s.lora >= 0) {
            auto lora = loras.find(s.lora);
            SPARROW_CHECK(lora != loras.end(), "step plan: unknown LoRA adapter ", s.lora);
            states[i].lora = lora->second;
          }
          parts.emplace_back(&states[i], std::vector<int32_t>(plan.tokens.begin() + row, plan.tokens.begin() + row + s.count));
          row += s.count;
        }
        Batch batch = make_batch(parts);
        for (size_t i = 0; i < plan.seqs.size(); ++i) batch.seqs[i].logits = plan.seqs[i].logits;
        batch.all_logits = plan.all_logits;
        batch.group_tokens = plan.group_tokens;
        if (!plan.embedded_rows.empty()) {
          const int64_t n = int64_t(plan.embedded_rows.size());
          batch.embedded_rows = std::move(plan.embedded_rows);
          auto values = std::make_shared<std::vector<float>>(std::move(plan.embedded));  // the tensor keeps them
          batch.embedded = Tensor::view(values->data(), {n, int64_t(values->size()) / n}, values);
        }
        runner.run(batch);
        for (auto& [cache, id] : mirrors) cache->drop_mirror(id);
        break;
      }
    }
  }
}

}  // namespace sparrow
