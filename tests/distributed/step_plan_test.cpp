// The plan rank 0 broadcasts to its tensor-parallel workers before each step (runner/step_plan.h): every
// kind survives encoding unchanged, and a damaged message (cut short, padded, of an unknown kind, or whose
// sequences do not add up to its tokens) is a one-line error, never a crash or a wrong step.
#include <gtest/gtest.h>

#include "core/error.h"
#include "runner/step_plan.h"

using namespace sparrow;

namespace {

StepPlan a_step() {
  StepPlan plan;
  plan.kind = StepPlan::Kind::Step;
  plan.state_ops = {{1, {3, -1}}, {0, {2, 5}}};
  plan.tokens = {11, 12, 13, 14, 15};
  StepPlan::Sequence prefill{.cache = 1, .start = 60, .count = 4, .blocks = {7, 2}, .state_slot = 3,
                             .snapshot_slot = 5, .snapshot_position = 64, .lora = 2};
  StepPlan::Sequence decode{.cache = 0, .start = 9, .count = 1, .blocks = {4}};
  plan.seqs = {prefill, decode};
  plan.all_logits = true;
  plan.group_tokens = {5, 0, 2};  // data parallel: this group's 5 tokens among the groups'
  plan.embedded_rows = {1, 2};   // an image's placeholders: rows 1 and 2 take these embeddings (hidden 3)
  plan.embedded = {0.5f, -1.0f, 2.0f, 3.25f, 0.0f, -0.125f};
  return plan;
}

}  // namespace

TEST(StepPlan, EveryKindSurvivesEncoding) {
  const StepPlan step = decode_plan(encode_plan(a_step()));
  const StepPlan want = a_step();
  EXPECT_EQ(step.kind, StepPlan::Kind::Step);
  ASSERT_EQ(step.state_ops.size(), 2u);
  EXPECT_EQ(step.state_ops[1].cache, 0);
  EXPECT_EQ(step.state_ops[1].op.state_slot, 2);
  EXPECT_EQ(step.state_ops[1].op.from_snapshot, 5);
  EXPECT_EQ(step.tokens, want.tokens);
  ASSERT_EQ(step.seqs.size(), 2u);
  EXPECT_EQ(step.seqs[0].blocks, want.seqs[0].blocks);
  EXPECT_EQ(step.seqs[0].start, 60);
  EXPECT_EQ(step.seqs[0].count, 4);
  EXPECT_EQ(step.seqs[0].state_slot, 3);
  EXPECT_EQ(step.seqs[0].snapshot_slot, 5);
  EXPECT_EQ(step.seqs[0].snapshot_position, 64);
  EXPECT_EQ(step.seqs[1].state_slot, -1);
  EXPECT_EQ(step.seqs[0].lora, 2);
  EXPECT_EQ(step.seqs[1].lora, -1);
  EXPECT_TRUE(step.all_logits);
  EXPECT_EQ(step.group_tokens, want.group_tokens);
  EXPECT_EQ(step.embedded_rows, want.embedded_rows);
  EXPECT_EQ(step.embedded, want.embedded);

  StepPlan cache;
  cache.kind = StepPlan::Kind::Cache;
  cache.cache = 4;
  cache.config.block_size = 128;
  cache.config.kv_cache_dtype = "fp8_ds_mla";
  cache.config.indexer_kv_dtype = "mxfp4";
  cache.config.max_num_seqs = 17;
  cache.config.enable_prefix_caching = false;
  cache.config.num_blocks = 1234;
  const StepPlan got = decode_plan(encode_plan(cache));
  EXPECT_EQ(got.kind, StepPlan::Kind::Cache);
  EXPECT_EQ(got.cache, 4);
  EXPECT_EQ(got.config.block_size, 128);
  EXPECT_EQ(got.config.kv_cache_dtype, "fp8_ds_mla");
  EXPECT_EQ(got.config.indexer_kv_dtype, "mxfp4");
  EXPECT_EQ(got.config.max_num_seqs, 17);
  EXPECT_FALSE(got.config.enable_prefix_caching);
  EXPECT_EQ(got.config.num_blocks, 1234);

  StepPlan drop;
  drop.kind = StepPlan::Kind::DropCache;
  drop.cache = 9;
  EXPECT_EQ(decode_plan(encode_plan(drop)).cache, 9);
  StepPlan stop;
  stop.kind = StepPlan::Kind::Stop;
  EXPECT_EQ(decode_plan(encode_plan(stop)).kind, StepPlan::Kind::Stop);
  StepPlan lora;
  lora.kind = StepPlan::Kind::Lora;
  lora.cache = 3;
  lora.lora = {"sql-adapter", "/adapters/sql", "/models/base", 64};
  const StepPlan lora_got = decode_plan(encode_plan(lora));
  EXPECT_EQ(lora_got.kind, StepPlan::Kind::Lora);
  EXPECT_EQ(lora_got.cache, 3);
  EXPECT_EQ(lora_got.lora.name, "sql-adapter");
  EXPECT_EQ(lora_got.lora.path, "/adapters/sql");
  EXPECT_EQ(lora_got.lora.base_model, "/models/base");
  EXPECT_EQ(lora_got.lora.max_rank, 64);
  StepPlan drop_lora;
  drop_lora.kind = StepPlan::Kind::DropLora;
  drop_lora.cache = 3;
  EXPECT_EQ(decode_plan(encode_plan(drop_lora)).kind, StepPlan::Kind::DropLora);
  StepPlan idle;
  idle.kind = StepPlan::Kind::Idle;
  idle.group_tokens = {0, 7};
  const StepPlan idle_got = decode_plan(encode_plan(idle));
  EXPECT_EQ(idle_got.kind, StepPlan::Kind::Idle);
  EXPECT_EQ(idle_got.group_tokens, idle.group_tokens);
}

TEST(StepPlan, DamagedMessagesAreRefused) {
  const std::vector<uint8_t> bytes = encode_plan(a_step());
  for (size_t n = 0; n < bytes.size(); ++n) {
    const std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + n);
    EXPECT_THROW(decode_plan(cut), Error) << "cut to " << n << " of " << bytes.size() << " bytes";
  }
  std::vector<uint8_t> padded = bytes;
  padded.push_back(0);
  EXPECT_THROW(decode_plan(padded), Error);
  std::vector<uint8_t> unknown = bytes;
  unknown[0] = 0x7f;
  EXPECT_THROW(decode_plan(unknown), Error);

  StepPlan idle;  // an idle step says what the groups run
  idle.kind = StepPlan::Kind::Idle;
  EXPECT_THROW(decode_plan(encode_plan(idle)), Error);

  StepPlan short_of_tokens = a_step();
  short_of_tokens.tokens.pop_back();
  EXPECT_THROW(decode_plan(encode_plan(short_of_tokens)), Error);
  StepPlan empty_sequence = a_step();
  empty_sequence.seqs[1].count = 0;
  empty_sequence.tokens.pop_back();
  EXPECT_THROW(decode_plan(encode_plan(empty_sequence)), Error);
  StepPlan row_outside = a_step();  // an embedded row past the step's rows
  row_outside.embedded_rows[1] = 5;
  EXPECT_THROW(decode_plan(encode_plan(row_outside)), Error);
  StepPlan ragged = a_step();  // embeddings that are not rows x hidden
  ragged.embedded.pop_back();
  EXPECT_THROW(decode_plan(encode_plan(ragged)), Error);
  StepPlan no_values = a_step();
  no_values.embedded.clear();
  EXPECT_THROW(decode_plan(encode_plan(no_values)), Error);
}
