// `sparrow bench collectives` (src/bench/collectives.h): the bench checks every size's result before timing
// it, so a communicator that returns wrong data fails the run (a faulty one-rank communicator here), the bus
// bandwidth factors are nccl-tests', and the command, run as a user runs it, times every operation between
// real processes (-tp 2 and an odd group of 3), writes its JSON rows, and refuses bad flags in one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "bench/collectives.h"
#include "core/error.h"

namespace fs = std::filesystem;
using namespace sparrow;

namespace {

// A group of one on the host whose all-reduce can be told to get one element wrong.
class OneRank : public Communicator {
 public:
  bool corrupt_all_reduce = false;
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Device device() const override { return Device::Cpu; }
  std::string backend() const override { return "test"; }
  void all_reduce(void* data, int64_t count, ScalarType) override {
    if (corrupt_all_reduce && count > 3) static_cast<float*>(data)[3] += 1.0f;
  }
  void all_gather(const void* send, void* recv, int64_t count, ScalarType) override {
    std::memcpy(recv, send, size_t(count) * 4);
  }
  void reduce_scatter(const void* send, void* recv, int64_t count, ScalarType) override {
    std::memcpy(recv, send, size_t(count) * 4);
  }
  void all_to_all(const void* send, void* recv, int64_t count, ScalarType) override {
    std::memcpy(recv, send, size_t(count) * 4);
  }
  void broadcast(void*, int64_t, int) override {}
  void send(const void*, int64_t, int) override {}
  void recv(void*, int64_t, int) override {}
  void barrier() override {}
};

using sparrow::testing::CliRun;

CliRun run(const std::string& args) { return sparrow::testing::run_sparrow(args, "", 120); }

std::vector<nlohmann::json> read_rows(const fs::path& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

}  // namespace

TEST(BenchCollectives, ChecksEveryResultBeforeTiming) {
  OneRank comm;
  bench::CollectiveBenchOptions options;
  options.min_bytes = 1024;
  options.max_bytes = 4096;
  options.iterations = 2;
  const auto rows = bench::bench_collectives(comm, options);
  EXPECT_EQ(rows.size(), bench::collective_names().size() * 3);  // 1K, 2K, 4K each
  comm.corrupt_all_reduce = true;
  try {
    bench::bench_collectives(comm, options);
    FAIL() << "a wrong all-reduce was timed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce of 1024 bytes gave rank 0 "), std::string::npos) << e.what();
  }
  options.ops = {"all_reduce", "scatter"};
  EXPECT_THROW(bench::bench_collectives(comm, options), Error);
  options.ops.clear();
  options.min_bytes = 8192;  // above the largest
  EXPECT_THROW(bench::bench_collectives(comm, options), Error);
}

TEST(BenchCollectives, BusFactorsAreNcclTests) {
  EXPECT_DOUBLE_EQ(bench::bus_factor("all_reduce", 8), 2.0 * 7 / 8);
  EXPECT_DOUBLE_EQ(bench::bus_factor("all_gather", 4), 0.75);
  EXPECT_DOUBLE_EQ(bench::bus_factor("reduce_scatter", 2), 0.5);
  EXPECT_DOUBLE_EQ(bench::bus_factor("all_to_all", 4), 0.75);
  EXPECT_DOUBLE_EQ(bench::bus_factor("broadcast", 8), 1.0);
}

TEST(BenchCollectives, CommandTimesEveryOperationBetweenProcesses) {
  const fs::path dir = fs::temp_directory_path() / ("sparrow_collectives_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path json = dir / "two.jsonl";
  CliRun r = run("bench collectives -tp 2 --max-bytes 64K --iterations 3 --json " + json.string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("busbw_GB/s"), std::string::npos) << r.out;
  const auto rows = read_rows(json);
  ASSERT_EQ(rows.size(), 5u * 7u);  // five operations, 1K .. 64K
  std::map<std::string, std::set<int64_t>> sizes;
  for (const auto& row : rows) {
    EXPECT_EQ(row["ranks"], 2);
    EXPECT_EQ(row["backend"], "gloo/tcp");
    EXPECT_GT(row["median_us"].get<double>(), 0.0);
    const double ratio = row["busbw_gbps"].get<double>() / row["algbw_gbps"].get<double>();
    EXPECT_NEAR(ratio, bench::bus_factor(row["op"], 2), 1e-9) << row.dump();
    sizes[row["op"]].insert(row["bytes"].get<int64_t>());
  }
  ASSERT_EQ(sizes.size(), 5u);
  for (const auto& [op, s] : sizes) EXPECT_EQ(*s.rbegin(), 65536) << op;

  // An odd group: the sizes become whole shares (multiples of 3 floats) where the operation splits them.
  const fs::path three = dir / "three.jsonl";
  r = run("bench collectives -tp 3 --op all_gather,all_to_all,all_reduce --min-bytes 1K --max-bytes 4K --iterations 2 "
          "--json " + three.string());
  ASSERT_EQ(r.status, 0) << r.err;
  const auto odd = read_rows(three);
  ASSERT_EQ(odd.size(), 9u);
  for (const auto& row : odd) {
    EXPECT_EQ(row["ranks"], 3);
    if (row["op"] != "all_reduce") EXPECT_EQ(row["bytes"].get<int64_t>() % 12, 0) << row.dump();
  }
  fs::remove_all(dir);
}

TEST(BenchCollectives, BadFlagsAreOneLineErrors) {
  auto expect_one_line_error = [](const CliRun& r, const std::string& must_contain) {
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(must_contain), std::string::npos) << r.err;
  };
  expect_one_line_error(run("bench collectives --max-bytes 4K"), "needs a group of processes");
  expect_one_line_error(run("bench collectives -tp 2 --max-bytes 4K --op all_reduce,gather"),
                        "unknown operation 'gather'");
  expect_one_line_error(run("bench collectives -tp 2 --max-bytes 4Q"), "not a size: '4Q'");
  expect_one_line_error(run("bench collectives -tp 2 --min-bytes 8K --max-bytes 4K"), "--min-bytes <= --max-bytes");
}
