// Helpers the vision towers' CPU tests share (minimax_m3_vision_test.cpp, kimi_k3_vision_test.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "model/model.h"
#include "model/vision_encoder.h"
#include "test_util.h"

namespace sparrow::vision_test {

// The largest difference from the reference, over the reference's largest magnitude.
inline double relative_gap(const Tensor& got, const Tensor& want) {
  EXPECT_EQ(got.shape(), want.shape());
  if (got.shape() != want.shape()) return INFINITY;
  double gap = 0, scale = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    gap = std::max(gap, double(std::fabs(got.data()[i] - want.data()[i])));
    scale = std::max(scale, double(std::fabs(want.data()[i])));
  }
  return gap / scale;
}

struct PromptImage {
  int64_t offset;
  Tensor embeddings;
};

// The prompt's logits, run chunk by chunk through one sequence, each chunk's image rows placed by ImageRows.
inline Tensor run_prompt(Model& model, const std::vector<int32_t>& ids, const std::vector<PromptImage>& images,
                         const std::vector<int64_t>& chunks) {
  SequenceState seq = sparrow::testing::new_sequence(model);
  Tensor all = Tensor::empty({int64_t(ids.size()), model.vocab_size()});
  int64_t done = 0;
  for (int64_t len : chunks) {
    Batch batch = make_batch({{&seq, {ids.begin() + done, ids.begin() + done + len}}});
    ImageRows rows;
    for (const PromptImage& image : images) rows.add(0, done, len, image.offset, image.embeddings);
    rows.attach_to(batch);
    const Tensor logits = sparrow::testing::run_step(model, batch);
    std::copy_n(logits.data(), logits.numel(), all.row(done));
    done += len;
  }
  EXPECT_EQ(done, int64_t(ids.size()));
  return all;
}

}  // namespace sparrow::vision_test
