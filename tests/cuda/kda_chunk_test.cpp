// kda_delta_rule_chunked (src/kernels/cuda/kda/chunk.cu) against the CPU delta rule of src/kernels/cpu/kda_reference.cpp
// (delta_rule_recurrent, the definition; delta_rule_chunked in one case): outputs and final states on
// random shapes, ragged sequences (1, 63, 64, 65, ... 5000 rows, some with none), nonzero starting states in
// slots at an offset, q/k/v as column ranges of one fused buffer or apart, normalize_qk on and off, a
// prefill continued by a second launch, steep decays (the exact diagonal-block path), unaligned rows, every
// value-tile width of the walk.
//
// Tolerance: 2e-2 relative L2 error per D-vector (output row of a head, state row), with a floor of 1e-2
// times the reference's RMS vector norm. The walk's products take bf16 operands (W, Q', Kd, and each chunk's
// S and Vn rounded to 8 significant bits: relative error <= 2^-9 each, so ~2^-8 per product), summed in
// fp32; the per-chunk preparation uses tf32 (2^-12). Errors of one chunk's state are damped by the decays
// and by the delta rule's own correction of later chunks (Vn = U - W S subtracts what S predicts), so they
// do not grow with the length: the kernels' source run on a CPU emulation of the warp instructions, on
// inputs like these, gave at most 7e-3 (3000 tokens, decays near zero) and 3e-3 to 5e-3 typically; fp32
// throughout would give ~1e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "gpu_test_util.h"
#include "kda_test_util.h"
#include "kernels/cuda/kda/kda.h"
#include "core/device/cuda_check.h"
#include "kernels/cpu/kda_reference.h"

namespace sparrow::cuda {
namespace {

constexpr double kTolerance = 2e-2;

using cpu::delta_rule_chunked;
using cpu::delta_rule_recurrent;
using cpu::DeltaRuleInputs;
using test::counts_str;
using test::offsets_of;
using test::compare_vectors;
using test::l2_normalize;
using States = test::KdaSlotStates;

uint64_t fresh_seed() { return std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32); }

struct Problem {
  int H, D;
  std::vector<int> counts;
  int64_t T = 0;
  std::vector<float> q, k, v, g, beta;  // [T, H, D] (beta [T, H]); q, k normalised as KdaMixer does
  std::vector<float> q_raw, k_raw;      // the same before the normalisation (the conv's outputs)
  std::vector<float> state0;            // [seqs, H, D, D]
};

// `decay` scales exp(A_log): 1 gives KdaMixer-like gates (mostly mild, some near 0, a few strong); 40 makes
// channels fall by more than e^-66 within 16 rows (the kernel's exact path); 0.01 keeps states for thousands
// of rows (where rounding errors could pile up).
Problem make_problem(int H, int D, const std::vector<int>& counts, float decay, std::mt19937_64& rng) {
  Problem p{H, D, counts};
  for (int c : counts) p.T += c;
  const size_t n = size_t(p.T * H * D);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(-1.5f, 0.5f);
  p.q.resize(n);
  p.k.resize(n);
  p.v.resize(n);
  p.g.resize(n);
  p.beta.resize(size_t(p.T * H));
  for (size_t i = 0; i < n; ++i) {  // silu outputs are > -0.28; some heads' values large, some tiny
    p.q[i] = std::max(-0.27f, normal(rng)) * (i / D % 3 == 0 ? 5.0f : 1.0f);
    p.k[i] = std::max(-0.27f, normal(rng)) * (i / D % 4 == 1 ? 0.01f : 1.0f);
    p.v[i] = normal(rng);
  }
  p.q_raw = p.q;
  p.k_raw = p.k;
  for (int64_t i = 0; i < p.T * H; ++i) {
    l2_normalize(&p.q[i * D], D, float(1.0 / std::sqrt(double(D))));
    l2_normalize(&p.k[i * D], D, 1.0f);
  }
  std::vector<float> A(H);
  for (auto& a : A) a = std::exp(uni(rng)) * decay;
  for (size_t i = 0; i < n; ++i) {
    const float x = normal(rng) * 2.0f - 1.0f;
    p.g[i] = -A[(i / D) % H] * (x > 20.0f ? x : std::log1p(std::exp(x)));
  }
  for (auto& b : p.beta) b = 1.0f / (1.0f + std::exp(-normal(rng)));
  p.state0.resize(counts.size() * size_t(H) * D * D);
  for (auto& x : p.state0) x = 0.5f * normal(rng);
  return p;
}

struct CaseOptions {
  bool fused = true;        // q, k, v as column ranges of one [rows, 3P + 8] buffer
  bool normalize = false;   // the kernel applies the l2 norms
  bool unaligned = false;   // row stride 3P + 1 and q/k/v one float off 16-byte alignment
  bool also_chunked = false;  // also compare with the CPU's chunked form
  const char* vt = nullptr;  // force the walk's value-tile width (SPARROW_KDA_CHUNK_VT)
};

// Runs the problem on the GPU in len(steps) launches: launch i advances sequence s by steps[i][s] rows (the
// sum per sequence is its count), as a chunked prefill would; compares all outputs and the final states
// with delta_rule_recurrent over each sequence's whole run at once.
void run_case(const Problem& p, const std::vector<std::vector<int>>& steps, const CaseOptions& o,
              std::mt19937_64& rng) {
  const int H = p.H, D = p.D, S = int(p.counts.size());
  const int64_t P = int64_t(H) * D;
  const std::string what = "H=" + std::to_string(H) + " D=" + std::to_string(D) + " counts=" + counts_str(p.counts) +
                           " launches=" + std::to_string(steps.size()) + (o.fused ? " qkv fused" : " qkv apart") +
                           (o.normalize ? " l2norm in kernel" : "") + (o.unaligned ? " unaligned" : "") +
                           (o.vt ? std::string(" vt=") + o.vt : std::string());
  SCOPED_TRACE(what);

  std::vector<float> ref_out(p.q.size()), ref_state = p.state0;
  const std::vector<int32_t> full_off = offsets_of(p.counts);
  auto inputs_at = [&](int64_t row, int count) {
    DeltaRuleInputs in;
    in.length = count;
    in.num_heads = H;
    in.head_dim = D;
    in.q = p.q.data() + row * P;
    in.k = p.k.data() + row * P;
    in.v = p.v.data() + row * P;
    in.log_decay = p.g.data() + row * P;
    in.beta = p.beta.data() + row * H;
    return in;
  };
  for (int s = 0; s < S; ++s)
    if (p.counts[s] > 0)
      delta_rule_recurrent(inputs_at(full_off[s], p.counts[s]), ref_state.data() + size_t(s) * H * D * D,
                           ref_out.data() + full_off[s] * P);

  States states(S, P * D, rng);
  for (int s = 0; s < S; ++s) states.upload(s, p.state0.data() + size_t(s) * H * D * D);
  if (o.vt) setenv("SPARROW_KDA_CHUNK_VT", o.vt, 1);

  std::vector<float> got_out(p.q.size(), NAN);
  std::vector<int> done(S, 0);
  for (const std::vector<int>& step : steps) {
    const std::vector<int32_t> off = offsets_of(step);
    const int64_t rows = off[S];
    const int64_t stride = o.fused ? 3 * P + (o.unaligned ? 1 : 8) : P + (o.unaligned ? 1 : 0);
    const int64_t shift = o.unaligned ? 1 : 0;  // q starts one float into the buffer
    const int64_t kofs = o.fused ? P : std::max<int64_t>(rows, 1) * stride;
    std::vector<float> qkv(size_t(shift + 3 * std::max<int64_t>(rows, 1) * stride), NAN);
    std::vector<float> g(size_t(std::max<int64_t>(rows, 1) * P)), beta(size_t(std::max<int64_t>(rows, 1) * H));
    float* qh = qkv.data() + shift;
    for (int s = 0; s < S; ++s) {
      for (int i = 0; i < step[s]; ++i) {
        const int64_t src = full_off[s] + done[s] + i, dst = off[s] + i;
        std::memcpy(qh + dst * stride, &(o.normalize ? p.q_raw : p.q)[src * P], sizeof(float) * P);
        std::memcpy(qh + kofs + dst * stride, &(o.normalize ? p.k_raw : p.k)[src * P], sizeof(float) * P);
        std::memcpy(qh + 2 * kofs + dst * stride, &p.v[src * P], sizeof(float) * P);
        std::memcpy(&g[dst * P], &p.g[src * P], sizeof(float) * P);
        std::memcpy(&beta[dst * H], &p.beta[src * H], sizeof(float) * H);
      }
    }
    test::DeviceArray<float> d_qkv(qkv), d_g(g), d_beta(beta), d_out(size_t(std::max<int64_t>(rows, 1) * P));
    test::DeviceArray<int32_t> d_off(off);
    const size_t ws_bytes = kda_delta_rule_chunked_workspace_bytes(rows, S, H, D);
    test::DeviceArray<uint8_t> d_ws(ws_bytes);
    d_out.poison();
    d_ws.poison();  // every record the walk reads must have been written by this launch
    const float* dq = d_qkv.ptr + shift;
    kda_delta_rule_chunked(dq, dq + kofs, dq + 2 * kofs, stride, d_g.ptr, d_beta.ptr, d_out.ptr, H, D, o.normalize,
                           states.seqs(d_off, *std::max_element(step.begin(), step.end())), states.offset, d_ws.ptr,
                           nullptr);
    SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> out = d_out.download();
    for (int s = 0; s < S; ++s) {
      for (int i = 0; i < step[s]; ++i)
        std::memcpy(&got_out[(full_off[s] + done[s] + i) * P], &out[(off[s] + i) * P], sizeof(float) * P);
      done[s] += step[s];
    }
  }
  if (o.vt) unsetenv("SPARROW_KDA_CHUNK_VT");

  double worst_out = 0, worst_state = 0;
  const int bad_out = compare_vectors(got_out, ref_out, D, kTolerance, what + " out", &worst_out);
  std::vector<float> got_state(ref_state.size());
  for (int s = 0; s < S; ++s) {
    const std::vector<float> st = states.download(s);
    std::copy(st.begin(), st.end(), got_state.begin() + size_t(s) * H * D * D);
  }
  // Row by row (the D values of one key index); a sequence with no rows must keep its state as it was.
  const int bad_state = compare_vectors(got_state, ref_state, D, kTolerance, what + " state", &worst_state);
  EXPECT_EQ(bad_out, 0) << what << ": " << bad_out << " bad output vectors";
  EXPECT_EQ(bad_state, 0) << what << ": " << bad_state << " bad state rows";
  if (o.also_chunked) {
    std::vector<float> chunk_out(p.q.size()), chunk_state = p.state0;
    for (int s = 0; s < S; ++s)
      if (p.counts[s] > 0)
        delta_rule_chunked(inputs_at(full_off[s], p.counts[s]), chunk_state.data() + size_t(s) * H * D * D,
                           chunk_out.data() + full_off[s] * P);
    double w = 0;
    EXPECT_EQ(compare_vectors(got_out, chunk_out, D, kTolerance, what + " out vs CPU chunked", &w), 0);
    EXPECT_EQ(compare_vectors(got_state, chunk_state, D, kTolerance, what + " state vs CPU chunked", &w), 0);
  }
  std::printf("  %s: worst rel err out %.2e state %.2e\n", what.c_str(), worst_out, worst_state);
}

// A random split of each sequence's rows over two launches (the first may end inside a chunk).
std::vector<std::vector<int>> split_in_two(const std::vector<int>& counts, std::mt19937_64& rng) {
  std::vector<std::vector<int>> steps(2, std::vector<int>(counts.size()));
  for (size_t s = 0; s < counts.size(); ++s) {
    steps[0][s] = int(rng() % uint64_t(counts[s] + 1));
    steps[1][s] = counts[s] - steps[0][s];
  }
  return steps;
}

TEST(CudaKdaChunk, MatchesRecurrentReference) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  for (const int D : {64, 128}) {
    for (int trial = 0; trial < 3; ++trial) {
      const int H = 1 + int(rng() % 16);
      // Single rows, chunk edges, an empty sequence, several chunks, a random length.
      std::vector<int> counts = {1, 63, 64, 65, 0, 130, 1 + int(rng() % 300)};
      if (trial == 2) counts.push_back(1000);
      std::shuffle(counts.begin(), counts.end(), rng);
      const Problem p = make_problem(H, D, counts, 1.0f, rng);
      CaseOptions o;
      o.fused = rng() % 2 == 0;
      o.normalize = trial == 1;
      o.also_chunked = trial == 0;
      run_case(p, {counts}, o, rng);
    }
  }
  // One long prompt (few heads: the CPU reference walks it token by token).
  const Problem p = make_problem(2, 128, {5000}, 1.0f, rng);
  CaseOptions o;
  o.normalize = true;
  run_case(p, {p.counts}, o, rng);
}

TEST(CudaKdaChunk, PrefillContinuedBySecondLaunch) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  for (const int D : {64, 128}) {
    const int H = 1 + int(rng() % 16);
    std::vector<int> counts = {200, 1, 0, 64, 129, 7 + int(rng() % 500)};
    const Problem p = make_problem(H, D, counts, 1.0f, rng);
    CaseOptions o;
    o.fused = true;
    o.normalize = D == 128;
    run_case(p, split_in_two(counts, rng), o, rng);
    // Split exactly at a chunk edge for some, one row in for others.
    run_case(p, {{64, 1, 0, 64, 65, 1}, {136, 0, 0, 0, 64, counts[5] - 1}}, o, rng);
  }
}

TEST(CudaKdaChunk, SteepAndSlowDecays) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  for (const int D : {64, 128}) {
    // Steep: most channels fall by far more than e^-66 within 16 rows (the exact diagonal-block path).
    const Problem steep = make_problem(3, D, {300, 17, 64}, 40.0f, rng);
    run_case(steep, {steep.counts}, CaseOptions{}, rng);
    // Slow: states carried across thousands of rows.
    const Problem slow = make_problem(2, D, {3000, 100}, 0.01f, rng);
    run_case(slow, {slow.counts}, CaseOptions{}, rng);
  }
}

TEST(CudaKdaChunk, UnalignedRowsAndManySequences) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  for (const int D : {64, 128}) {
    const Problem p = make_problem(5, D, {70, 1, 200, 0, 64}, 1.0f, rng);
    CaseOptions o;
    o.unaligned = true;
    o.fused = D == 64;
    o.normalize = true;
    run_case(p, {p.counts}, o, rng);
  }
  // Many short sequences: many (sequence, head) pairs, so the walk takes wide value tiles.
  std::vector<int> counts(48);
  for (int& c : counts) c = int(rng() % 150);
  const Problem p = make_problem(3, 128, counts, 1.0f, rng);
  run_case(p, {counts}, CaseOptions{}, rng);
}

TEST(CudaKdaChunk, EveryValueTileWidth) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  for (const int D : {64, 128}) {
    const Problem p = make_problem(4, D, {129, 0, 1, 64}, 1.0f, rng);
    for (const char* vt : {"16", "32", "64", "128"}) {
      if (std::atoi(vt) > D) continue;
      CaseOptions o;
      o.vt = vt;
      o.normalize = true;
      run_case(p, split_in_two(p.counts, rng), o, rng);
    }
  }
}

TEST(CudaKdaChunk, RejectsUnsupportedHeadDimAndLeavesEmptyLaunches) {
  SPARROW_REQUIRE_GPU();
  EXPECT_THROW(kda_delta_rule_chunked_workspace_bytes(64, 1, 2, 32), Error);
  EXPECT_THROW(kda_delta_rule_chunked(nullptr, nullptr, nullptr, 96, nullptr, nullptr, nullptr, 1, 32, false,
                                      KdaSequences{}, 0, nullptr, nullptr),
               Error);
  // No rows at all: nothing runs, the workspace may be null, states stay.
  std::mt19937_64 rng(fresh_seed());
  States states(2, 2 * 64 * 64, rng);
  std::vector<float> st(size_t(2 * 64 * 64), 0.25f);
  states.upload(0, st.data());
  const std::vector<int32_t> zeros = {5, 5, 5};
  test::DeviceArray<int32_t> d_off(zeros);
  kda_delta_rule_chunked(nullptr, nullptr, nullptr, 128, nullptr, nullptr, nullptr, 2, 64, false,
                         states.seqs(d_off, 0), states.offset, nullptr, nullptr);
  SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(states.download(0), st);
}

}  // namespace
}  // namespace sparrow::cuda
