// Loading at the disk's speed (issue 22 item 4): the progress lines (formats/load_progress.h), the shard
// read-ahead (formats/shard_prefetch.h) and their use by Checkpoint and load_model.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "formats/checkpoint.h"
#include "formats/load_progress.h"
#include "formats/shard_prefetch.h"
#include "model/families.h"
#include "model/model.h"
#include "test_util.h"

using namespace sparrow;
using sparrow::testing::error_message;
using sparrow::testing::mentions;
using sparrow::testing::TempDir;

namespace fs = std::filesystem;

namespace {

// What a LoadProgress printed into a memory stream.
struct Captured {
  char* text = nullptr;
  size_t size = 0;
  std::FILE* file = open_memstream(&text, &size);
  std::string read() {
    std::fflush(file);
    return std::string(text, size);
  }
  ~Captured() {
    std::fclose(file);
    std::free(text);
  }
};

}  // namespace

TEST(LoadProgress, LinesSayHowFarAndHowFast) {
  EXPECT_EQ(LoadProgress::bar(int64_t(12.3e9), int64_t(27e9), 4.0), "loading weights  46%  12.3 / 27.0 GB  3.1 GB/s");
  EXPECT_EQ(LoadProgress::summary(int64_t(27e9), 8.4), "loaded 27.0 GB of weights in 8.4 s (3.21 GB/s)");

  // Not a terminal: a line at each tenth passed, then the summary.
  Captured out;
  LoadProgress progress(1000, out.file, /*live=*/false);
  for (int i = 0; i < 100; ++i) progress.add(10);
  progress.finish();
  progress.finish();  // once only
  const std::string text = out.read();
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 10) << text;  // 10%..90%, then the summary
  EXPECT_NE(text.find("loading weights  50%"), std::string::npos) << text;
  EXPECT_NE(text.find("loaded 0.0 GB of weights in"), std::string::npos) << text;
  EXPECT_EQ(progress.done(), 1000);
}

TEST(ShardPrefetch, ReadsEveryFileAndStaysWithinItsWindow) {
  TempDir dir;
  std::vector<std::string> paths;
  for (int i = 0; i < 3; ++i) {
    const std::string path = dir.file("shard" + std::to_string(i));
    std::ofstream(path) << std::string((40 << 20) + i, 'x');
    paths.push_back(path);
  }
  // Nothing taken, a window of 1 MB: each reader reads one 16 MB chunk of its file and waits.
  std::atomic<int64_t> taken{0};
  {
    ShardPrefetcher prefetch(paths, 2, 1 << 20, [&] { return taken.load(); });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_LE(prefetch.bytes_read(), 2 * (16 << 20));
    EXPECT_GT(prefetch.bytes_read(), 0);
    taken = int64_t(1) << 40;  // the loader caught up: the rest is read
    prefetch.wait();
    EXPECT_EQ(prefetch.bytes_read(), 3 * (40 << 20) + 0 + 1 + 2);
  }
  // Destroyed while waiting: it stops at once.
  taken = 0;
  const auto start = std::chrono::steady_clock::now();
  { ShardPrefetcher prefetch(paths, 3, 0, [&] { return taken.load(); }); }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(LoadModel, CountsEveryStoredByteAndShowsProgress) {
  const fs::path fixture = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/deepseek_v32_fp8";  // 3 shards
  auto checkpoint = Checkpoint::open(fixture.string());
  LoadProgress progress(checkpoint->total_bytes(), nullptr, false);
  checkpoint->report_to(&progress);
  checkpoint->prefetch(2, 1 << 20);
  const ModelFamily& family = model_family(checkpoint->config());
  auto model = family.load(*checkpoint, family.text(checkpoint->config()), family.weight_prefix);
  // Every tensor was taken (the family's loader calls finish()), each counted once: weights, FP8 scales.
  EXPECT_EQ(progress.done(), checkpoint->total_bytes());
  EXPECT_EQ(checkpoint->bytes_taken(), checkpoint->total_bytes());

  Captured out;
  LoadOptions options;
  options.load_format = "fastsafetensors";  // vLLM's name of the fast loader: the same path
  options.progress = out.file;
  options.progress_min_bytes = 0;
  load_model(fixture.string(), Device::Cpu, options);
  EXPECT_NE(out.read().find("loaded 0.0 GB of weights in"), std::string::npos) << out.read();
  options.progress_min_bytes = int64_t(1) << 30;  // a small checkpoint prints nothing by default
  Captured quiet;
  options.progress = quiet.file;
  load_model(fixture.string(), Device::Cpu, options);
  EXPECT_EQ(quiet.read(), "");
  options.load_format = "pt";
  EXPECT_TRUE(mentions(error_message([&] { load_model(fixture.string(), Device::Cpu, options); }),
                       {"--load-format must be auto, safetensors, fastsafetensors or dummy"}));
}
