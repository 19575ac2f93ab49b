// The encoder cache (engine/encoder_cache.h): a step's images that are not cached go through the tower in one call,
// each image once however often the list names it; cached ones are hits; the least recently used go past the
// capacity. A counting tower stands in for a real one (the towers' numerics: minimax_m3_vision_test.cpp,
// kimi_k3_vision_test.cpp).
#include <gtest/gtest.h>

#include <vector>

#include "engine/encoder_cache.h"

using namespace sparrow;

namespace {

// Row r of image i holds the image's first patch value (its id here) and r; one placeholder token per patch row.
class CountingTower : public VisionEncoder {
 public:
  Tensor embed(const Tensor& pixel_values, const std::vector<vision::VisionGrid>& grids) const override {
    ++calls;
    images += int64_t(grids.size());
    Tensor out = Tensor::empty({pixel_values.dim(0), 2});
    int64_t row = 0;
    for (const vision::VisionGrid& g : grids)
      for (int64_t r = 0; r < g.h * g.w; ++r, ++row) {
        out.row(row)[0] = pixel_values.row(row)[0];
        out.row(row)[1] = float(r);
      }
    return out;
  }
  int64_t tokens(const vision::VisionGrid& grid) const override { return grid.h * grid.w; }
  int64_t patch_width() const override { return 1; }
  int32_t image_token_id() const override { return 9; }
  mutable int64_t calls = 0, images = 0;
};

vision::ImageInput image(float id, int64_t rows) {
  vision::ImageInput in;
  in.grid = {1, 1, rows};
  in.tokens = rows;
  in.pixel_values = Tensor::zeros({rows, 1});
  for (int64_t r = 0; r < rows; ++r) in.pixel_values.row(r)[0] = id;
  in.hash = uint64_t(id * 1000);
  return in;
}

void expect_rows_of(const Tensor& t, float id, int64_t rows) {
  ASSERT_EQ(t.dim(0), rows);
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_EQ(t.row(r)[0], id);
    EXPECT_EQ(t.row(r)[1], float(r));
  }
}

}  // namespace

TEST(EncoderCache, AStepsMissingImagesGoThroughTheTowerInOneCall) {
  CountingTower tower;
  EncoderCache cache(100);
  const vision::ImageInput a = image(1, 3), b = image(2, 5), c = image(3, 2);
  std::vector<Tensor> got = cache.get({&a, &b, &a}, tower);  // a twice: embedded once
  EXPECT_EQ(tower.calls, 1);
  EXPECT_EQ(tower.images, 2);
  expect_rows_of(got[0], 1, 3);
  expect_rows_of(got[1], 2, 5);
  expect_rows_of(got[2], 1, 3);
  EXPECT_EQ(cache.misses(), 2);
  EXPECT_EQ(cache.hits(), 1);
  got = cache.get({&b, &c}, tower);  // b cached, c new: one more call, for c alone
  EXPECT_EQ(tower.calls, 2);
  EXPECT_EQ(tower.images, 3);
  expect_rows_of(got[0], 2, 5);
  expect_rows_of(got[1], 3, 2);
  got = cache.get({&a, &b, &c}, tower);  // all cached
  EXPECT_EQ(tower.calls, 2);
  EXPECT_EQ(cache.hits(), 5);
  EXPECT_EQ(cache.rows(), 10);
}

TEST(EncoderCache, TheLeastRecentlyUsedGoPastTheCapacity) {
  CountingTower tower;
  EncoderCache cache(8);
  const vision::ImageInput a = image(1, 4), b = image(2, 4), c = image(3, 4);
  cache.get({&a}, tower);
  cache.get({&b}, tower);
  cache.get({&a}, tower);  // a is now the most recent
  cache.get({&c}, tower);  // b goes
  EXPECT_EQ(cache.rows(), 8);
  EXPECT_EQ(tower.calls, 3);
  cache.get({&a, &c}, tower);
  EXPECT_EQ(tower.calls, 3);
  const std::vector<Tensor> got = cache.get({&b}, tower);
  EXPECT_EQ(tower.calls, 4);
  expect_rows_of(got[0], 2, 4);
  // More images in one call than the capacity holds: every one still gets its rows.
  const vision::ImageInput d = image(4, 6), e = image(5, 6);
  const std::vector<Tensor> both = cache.get({&d, &e, &d}, tower);
  expect_rows_of(both[0], 4, 6);
  expect_rows_of(both[1], 5, 6);
  expect_rows_of(both[2], 4, 6);
}
