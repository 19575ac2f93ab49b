// Kimi Delta Attention on the GPU (src/kernels/cuda/kda) against the CPU code of src/kernels/cpu/kda_reference.cpp: the delta
// rule against delta_rule_recurrent itself (outputs and final states, decode and prefill, prefill continued by
// decode steps), the short conv and its tail, the gates and the gated output norm against loops that follow
// KdaMixer::forward line by line.
#include "kernels/cuda/kda/kda.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kda_test_util.h"
#include "core/device/cuda_check.h"
#include "kernels/cpu/kda_reference.h"

namespace sparrow::cuda {
namespace {

using cpu::delta_rule_chunked;
using cpu::delta_rule_recurrent;
using cpu::DeltaRuleInputs;
using test::counts_str;
using test::offsets_of;
using test::compare_vectors;
using test::l2_normalize;
using States = test::KdaSlotStates;

uint64_t fresh_seed() { return std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32); }

// ---- delta rule ---------------------------------------------------------------------------------------
struct DeltaProblem {
  int H, D;
  std::vector<int> counts;
  int64_t T = 0;
  std::vector<float> q, k, v, g, beta;  // [T, H, D] (beta [T, H]); q, k normalised as KdaMixer does
  std::vector<float> q_raw, k_raw;      // the same before the normalisation (the conv's outputs)
  std::vector<float> state0;            // [seqs, H, D, D]
};

DeltaProblem make_delta_problem(int H, int D, const std::vector<int>& counts, std::mt19937_64& rng) {
  DeltaProblem p{H, D, counts};
  for (int c : counts) p.T += c;
  const size_t n = size_t(p.T * H * D);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(-1.5f, 0.5f);
  p.q.resize(n);
  p.k.resize(n);
  p.v.resize(n);
  p.g.resize(n);
  p.beta.resize(size_t(p.T * H));
  for (auto& x : p.q) x = normal(rng);
  for (auto& x : p.k) x = normal(rng);
  for (auto& x : p.v) x = normal(rng);
  for (size_t i = 0; i < n; ++i) {  // silu outputs are > -0.28; some heads' values large, some tiny
    p.q[i] = std::max(-0.27f, p.q[i]) * (i / D % 3 == 0 ? 5.0f : 1.0f);
    p.k[i] = std::max(-0.27f, p.k[i]) * (i / D % 4 == 1 ? 0.01f : 1.0f);
  }
  p.q_raw = p.q;
  p.k_raw = p.k;
  for (int64_t i = 0; i < p.T * H; ++i) {
    l2_normalize(&p.q[i * D], D, float(1.0 / std::sqrt(double(D))));
    l2_normalize(&p.k[i * D], D, 1.0f);
  }
  // g = -exp(A_log) * softplus(x): mostly mild decays, some channels near 0, a few strong ones.
  std::vector<float> A_log(H);
  for (auto& a : A_log) a = uni(rng);
  for (size_t i = 0; i < n; ++i) {
    const float x = normal(rng) * 2.0f - 1.0f;
    p.g[i] = -std::exp(A_log[(i / D) % H]) * (x > 20.0f ? x : std::log1p(std::exp(x)));
  }
  for (auto& b : p.beta) b = 1.0f / (1.0f + std::exp(-normal(rng)));
  p.state0.resize(counts.size() * size_t(H) * D * D);
  for (auto& x : p.state0) x = 0.5f * normal(rng);
  return p;
}

// Rows [row, row + count) of the problem through delta_rule_recurrent, state updated in place.
void cpu_delta(const DeltaProblem& p, int64_t row, int count, float* state, float* out) {
  DeltaRuleInputs in;
  in.length = count;
  in.num_heads = p.H;
  in.head_dim = p.D;
  const int64_t at = row * p.H * p.D;
  in.q = p.q.data() + at;
  in.k = p.k.data() + at;
  in.v = p.v.data() + at;
  in.log_decay = p.g.data() + at;
  in.beta = p.beta.data() + row * p.H;
  delta_rule_recurrent(in, state, out + at);
}

// Runs the problem on the GPU in `steps` launches: launch i advances sequence s by steps[i][s] rows (their sum
// per sequence is its count), as a prefill followed by decode steps would. Compares every launch's outputs and
// the final states with delta_rule_recurrent over each sequence's whole run at once.
void run_delta_case(const DeltaProblem& p, const std::vector<std::vector<int>>& steps, bool fused_qkv, bool normalize,
                    std::mt19937_64& rng, bool aligned_states = false) {
  const int H = p.H, D = p.D, S = int(p.counts.size());
  const int64_t P = int64_t(H) * D;
  std::string what = "H=" + std::to_string(H) + " D=" + std::to_string(D) + " counts=" + counts_str(p.counts) +
                     " launches=" + std::to_string(steps.size()) + (fused_qkv ? " qkv fused" : " qkv separate") +
                     (normalize ? " l2norm in kernel" : "") + (aligned_states ? " states 16-byte aligned" : "");
  SCOPED_TRACE(what);

  // Reference: each sequence's whole run at once.
  std::vector<float> ref_out(p.q.size()), ref_state = p.state0;
  const std::vector<int32_t> full_off = offsets_of(p.counts);
  for (int s = 0; s < S; ++s)
    if (p.counts[s] > 0)
      cpu_delta(p, full_off[s], p.counts[s], ref_state.data() + size_t(s) * H * D * D, ref_out.data());

  States states(S, P * D, rng, aligned_states);
  for (int s = 0; s < S; ++s) states.upload(s, p.state0.data() + size_t(s) * H * D * D);

  std::vector<float> got_out(p.q.size(), NAN);
  std::vector<int> done(S, 0);
  for (const std::vector<int>& step : steps) {
    // This launch's rows, sequence by sequence.
    const std::vector<int32_t> off = offsets_of(step);
    const int64_t rows = off[S];
    const int64_t stride = fused_qkv ? 3 * P + 8 : P;  // fused: [q | k | v | pad] rows
    std::vector<float> qkv(size_t(std::max<int64_t>(rows, 1) * (fused_qkv ? stride : 3 * P)), NAN);
    std::vector<float> g(size_t(rows * P)), beta(size_t(rows * H));
    float* qh = qkv.data();
    float* kh = fused_qkv ? qkv.data() + P : qkv.data() + rows * P;
    float* vh = fused_qkv ? qkv.data() + 2 * P : qkv.data() + 2 * rows * P;
    for (int s = 0; s < S; ++s) {
      for (int i = 0; i < step[s]; ++i) {
        const int64_t src = full_off[s] + done[s] + i, dst = off[s] + i;
        std::memcpy(qh + dst * stride, &(normalize ? p.q_raw : p.q)[src * P], sizeof(float) * P);
        std::memcpy(kh + dst * stride, &(normalize ? p.k_raw : p.k)[src * P], sizeof(float) * P);
        std::memcpy(vh + dst * stride, &p.v[src * P], sizeof(float) * P);
        std::memcpy(&g[dst * P], &p.g[src * P], sizeof(float) * P);
        std::memcpy(&beta[dst * H], &p.beta[src * H], sizeof(float) * H);
      }
    }
    test::DeviceArray<float> d_qkv(qkv), d_g(g), d_beta(beta), d_out(size_t(rows * P));
    test::DeviceArray<int32_t> d_off(off);
    d_out.poison();
    const int64_t kofs = fused_qkv ? P : rows * P;
    kda_delta_rule(d_qkv.ptr, d_qkv.ptr + kofs, d_qkv.ptr + 2 * kofs, stride, d_g.ptr, d_beta.ptr, d_out.ptr, H, D,
                   normalize, states.seqs(d_off, *std::max_element(step.begin(), step.end())), states.offset,
                   nullptr);
    SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> out = d_out.download();
    for (int s = 0; s < S; ++s) {
      for (int i = 0; i < step[s]; ++i)
        std::memcpy(&got_out[(full_off[s] + done[s] + i) * P], &out[(off[s] + i) * P], sizeof(float) * P);
      done[s] += step[s];
    }
  }

  double worst_out = 0, worst_state = 0;
  const int bad_out = compare_vectors(got_out, ref_out, D, 1e-4, what + " out", &worst_out);
  std::vector<float> got_state(ref_state.size());
  for (int s = 0; s < S; ++s) {
    const std::vector<float> st = states.download(s);
    std::copy(st.begin(), st.end(), got_state.begin() + size_t(s) * H * D * D);
  }
  // States compared row by row (D values of one key index): a sequence with no rows must be left untouched.
  const int bad_state = compare_vectors(got_state, ref_state, D, 1e-4, what + " state", &worst_state);
  EXPECT_EQ(bad_out, 0) << what << ": " << bad_out << " bad output vectors";
  EXPECT_EQ(bad_state, 0) << what << ": " << bad_state << " bad state rows";
  std::printf("  %s: worst rel err out %.2e state %.2e\n", what.c_str(), worst_out, worst_state);
}

TEST(CudaKda, DeltaRuleMatchesRecurrentReference) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  for (const int D : {16, 32, 64, 128}) {
    for (const int H : {2, 5, 8}) {
      // Decode, short, one chunk, several tiles, an empty sequence, one random length.
      std::vector<int> counts = {1, 5, 64, 200, 0, 1 + int(rng() % 100)};
      std::shuffle(counts.begin(), counts.end(), rng);
      const DeltaProblem p = make_delta_problem(H, D, counts, rng);
      run_delta_case(p, {counts}, rng() % 2 == 0, false, rng);
      run_delta_case(p, {counts}, true, true, rng);
    }
  }
  // Many sequences decoding one token each (the wide value slices).
  for (const int D : {32, 64, 128}) {
    const std::vector<int> counts(300, 1);
    const DeltaProblem p = make_delta_problem(4, D, counts, rng);
    run_delta_case(p, {counts}, true, D == 64, rng);
  }
  // One long prompt.
  const DeltaProblem p = make_delta_problem(3, 128, {1000 + int(rng() % 200)}, rng);
  run_delta_case(p, {p.counts}, false, false, rng);
}

TEST(CudaKda, DeltaRulePrefillThenDecodeEqualsOneRun) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  for (const int D : {16, 64, 128}) {
    const int H = 2 + int(rng() % 7);
    const std::vector<int> prompt = {70, 5, 1, 130 + int(rng() % 30)};
    const int decode_steps = 6;
    std::vector<int> counts = prompt;
    for (int& c : counts) c += decode_steps;
    const DeltaProblem p = make_delta_problem(H, D, counts, rng);
    std::vector<std::vector<int>> steps = {prompt};
    for (int i = 0; i < decode_steps; ++i) steps.push_back(std::vector<int>(prompt.size(), 1));
    run_delta_case(p, steps, rng() % 2 == 0, false, rng);
    // A prefill continued by a second prefill of a few rows (chunked prefill), then one decode step.
    std::vector<std::vector<int>> split = {{40, 2, 1, 100}, {30, 3, 0, 30 + prompt[3] - 130}, {0, 6, 6, 6}};
    for (size_t s = 0; s < prompt.size(); ++s) {
      int sum = 0;
      for (int i = 0; i < 2; ++i) sum += split[i][s];
      split[2][s] = counts[s] - sum;
    }
    run_delta_case(p, split, true, true, rng);
  }
}

// Launches in which no sequence has more than one row (decode steps) take kda_delta_rule's decode kernel
// (chosen by max_count == 1). Several steps in a row, each continuing the states the previous one left, at
// odd batch sizes and head counts, some sequences idle in some steps (their states must stay as they are),
// the states 16-byte aligned (16-byte loads) or not (mixed: 4-byte loads where a state is not).
TEST(CudaKda, DeltaRuleDecodeStepsMatchRecurrentReference) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  struct Shape {
    int H, S;
  };
  for (const int D : {16, 32, 64, 128}) {
    std::vector<Shape> shapes = {{1, 1}, {3, 7}, {5, 33}, {12, 130}};
    if (D == 128) shapes.push_back({96, 3});
    for (const Shape& shape : shapes) {
      constexpr int kSteps = 3;
      std::vector<std::vector<int>> steps(kSteps, std::vector<int>(shape.S, 1));
      for (auto& step : steps)
        for (int& c : step)
          if (shape.S > 1 && rng() % 5 == 0) c = 0;  // idle this step
      std::vector<int> counts(shape.S, 0);
      for (const auto& step : steps)
        for (int s = 0; s < shape.S; ++s) counts[s] += step[s];
      const DeltaProblem p = make_delta_problem(shape.H, D, counts, rng);
      for (const bool aligned : {true, false}) run_delta_case(p, steps, rng() % 2 == 0, rng() % 2 == 0, rng, aligned);
    }
  }
}

// ---- short conv ---------------------------------------------------------------------------------------
// KdaMixer::forward's loop: h = [tail | x], y[i][c] = silu(sum_j taps[c][j] h[i + j][c]), tail = h[n ..].
void cpu_conv(const float* x, float* y, int64_t n, int64_t C, const std::vector<float>& w, int K, float* tail) {
  const int64_t tail_rows = K - 1;
  std::vector<float> h(size_t((tail_rows + n) * C));
  std::memcpy(h.data(), tail, sizeof(float) * tail_rows * C);
  std::memcpy(h.data() + tail_rows * C, x, sizeof(float) * n * C);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < C; ++c) {
      float sum = 0.0f;
      for (int j = 0; j < K; ++j) sum += w[c * K + j] * h[(i + j) * C + c];
      y[i * C + c] = sum / (1.0f + std::exp(-sum));
    }
  }
  std::memcpy(tail, h.data() + n * C, sizeof(float) * tail_rows * C);
}

TEST(CudaKda, ShortConvMatchesCpuLoop) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Case {
    int64_t C;
    int K;
    std::vector<int> counts;
    int launches;  // the counts split over this many launches (prefill, then decode-sized steps)
  };
  const std::vector<Case> cases = {
      {96, 4, {1, 5, 64, 200, 0, 2, 3}, 1},    // the fixture's 3 * 2 * 16 channels
      {4608, 4, {1, 1, 1, 1, 1, 1, 1, 1}, 1},  // Kimi K3.1 Pro at TP8: 3 * 12 * 128, decode
      {4608, 4, {130, 1, 7}, 1},               // prefill across chunks of 64
      {200, 4, {9, 2, 1, 70}, 4},              // channels not a multiple of the block; chained launches
      {300, 2, {3, 1, 65}, 3},
      {130, 3, {1, 2, 200}, 2},
      {64, 8, {3, 5, 20}, 3},  // counts below K - 1 shift the tail
  };
  for (const Case& cs : cases) {
    const int64_t C = cs.C;
    const int K = cs.K, S = int(cs.counts.size());
    std::string what = "C=" + std::to_string(C) + " K=" + std::to_string(K) + " counts=" + counts_str(cs.counts) +
                       " launches=" + std::to_string(cs.launches);
    SCOPED_TRACE(what);
    std::vector<float> w(size_t(C * K));
    for (auto& x : w) x = 0.5f * normal(rng);
    std::vector<float> tails0(size_t(S * (K - 1) * C));
    for (auto& x : tails0) x = normal(rng);
    const std::vector<int32_t> full_off = offsets_of(cs.counts);
    std::vector<float> x(size_t(std::max(1, full_off[S]) * C));
    for (auto& e : x) e = normal(rng);

    // Split each sequence's rows over the launches: a random first part, then the rest in random pieces.
    std::vector<std::vector<int>> steps(cs.launches, std::vector<int>(S, 0));
    for (int s = 0; s < S; ++s) {
      int left = cs.counts[s];
      for (int l = 0; l < cs.launches; ++l) {
        const int take = l + 1 == cs.launches ? left : int(rng() % uint64_t(left + 1));
        steps[l][s] = take;
        left -= take;
      }
    }

    std::vector<float> ref_y(x.size(), 0.0f), ref_tails = tails0;
    std::vector<int> done(S, 0);
    States tails(S, (K - 1) * C, rng);
    for (int s = 0; s < S; ++s) tails.upload(s, tails0.data() + size_t(s) * (K - 1) * C);
    test::DeviceArray<float> d_w(w);
    std::vector<float> got_y(x.size(), NAN);
    for (const std::vector<int>& step : steps) {
      const std::vector<int32_t> off = offsets_of(step);
      const int64_t rows = off[S];
      std::vector<float> xs(size_t(std::max<int64_t>(rows, 1) * C));
      for (int s = 0; s < S; ++s) {
        const int64_t src = full_off[s] + done[s];
        std::memcpy(&xs[off[s] * C], &x[src * C], sizeof(float) * step[s] * C);
        // The reference, launch by launch as the engine would call it (KdaMixer keeps the tail between steps).
        cpu_conv(&x[src * C], &ref_y[src * C], step[s], C, w, K, ref_tails.data() + size_t(s) * (K - 1) * C);
      }
      test::DeviceArray<float> d_x(xs), d_y(xs.size());
      test::DeviceArray<int32_t> d_off(off);
      d_y.poison();
      int max_count = 0;
      for (int c : step) max_count = std::max(max_count, c);
      kda_short_conv(d_x.ptr, d_y.ptr, C, d_w.ptr, K, tails.seqs(d_off, max_count), tails.offset, nullptr);
      SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> ys = d_y.download();
      for (int s = 0; s < S; ++s) {
        std::memcpy(&got_y[(full_off[s] + done[s]) * C], &ys[off[s] * C], sizeof(float) * step[s] * C);
        done[s] += step[s];
      }
    }
    int bad = 0;
    double worst = 0;
    for (int64_t i = 0; i < full_off[S] * C; ++i) {
      const double err = std::fabs(double(got_y[i]) - ref_y[i]) / std::max(1.0, std::fabs(double(ref_y[i])));
      if (std::isfinite(got_y[i])) worst = std::max(worst, err);
      if (!(err <= 1e-5) && bad++ < 5)
        ADD_FAILURE() << what << ": row " << i / C << " channel " << i % C << " got " << got_y[i] << " want "
                      << ref_y[i];
    }
    EXPECT_EQ(bad, 0) << what;
    // The tails are copies of inputs: exact.
    for (int s = 0; s < S; ++s) {
      const std::vector<float> got = tails.download(s);
      const float* want = ref_tails.data() + size_t(s) * (K - 1) * C;
      EXPECT_EQ(0, std::memcmp(got.data(), want, sizeof(float) * got.size())) << what << ": tail of sequence " << s;
    }
    std::printf("  %s: worst rel err %.2e\n", what.c_str(), worst);
  }
}

// ---- prefix-cache snapshots ---------------------------------------------------------------------------
// kda_copy_states copies exactly the asked bytes of the sequences that have a snapshot slot and touches
// nothing else (the other slots, the bytes around the copied range).
TEST(CudaKda, CopyStatesCopiesOnlyRequestedSlots) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 5; ++trial) {
    const int S = 1 + int(rng() % 40);
    const int64_t slot_bytes = 64 * (1 + int64_t(rng() % 64)), offset = 16 * int64_t(rng() % (slot_bytes / 16));
    const int64_t bytes = 16 * int64_t(rng() % ((slot_bytes - offset) / 16 + 1));
    std::vector<uint8_t> states(size_t(S * slot_bytes)), snaps(size_t(S * slot_bytes));
    for (auto& b : states) b = uint8_t(rng());
    for (auto& b : snaps) b = uint8_t(rng());
    test::DeviceArray<uint8_t> d_states(states), d_snaps(snaps);
    std::vector<uint8_t*> slot_ptrs(S), snap_ptrs(S);
    std::vector<uint8_t> want = snaps;
    std::vector<int> target(S);  // a shuffled slot per sequence: distinct, like a cache's snapshot slots
    for (int s = 0; s < S; ++s) target[s] = s;
    std::shuffle(target.begin(), target.end(), rng);
    for (int s = 0; s < S; ++s) {
      slot_ptrs[s] = d_states.ptr + s * slot_bytes;
      const bool take = rng() % 2;
      snap_ptrs[s] = take ? d_snaps.ptr + target[s] * slot_bytes : nullptr;
      if (take) std::memcpy(&want[target[s] * slot_bytes + offset], &states[s * slot_bytes + offset], size_t(bytes));
    }
    test::DeviceArray<uint8_t*> d_slot_ptrs(slot_ptrs), d_snap_ptrs(snap_ptrs);
    const std::vector<int32_t> rows(size_t(S + 1), 0);
    test::DeviceArray<int32_t> d_rows(rows);
    kda_copy_states(KdaSequences{d_rows.ptr, d_rows.ptr + 1, d_slot_ptrs.ptr, S, 0}, d_snap_ptrs.ptr, offset, bytes,
                    nullptr);
    SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(want, d_snaps.download()) << "S=" << S << " slot " << slot_bytes << " offset " << offset << " bytes "
                                        << bytes;
    EXPECT_EQ(states, d_states.download());
  }
  EXPECT_THROW(kda_copy_states(KdaSequences{}, nullptr, 8, 16, nullptr), Error);
}

// ---- gates and gated norm -----------------------------------------------------------------------------
TEST(CudaKda, GatesMatchCpuFormula) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // lower_bound 0: Kimi Linear's -exp(A) softplus(s); -5: Kimi K3's bounded -5 sigmoid(exp(A) s).
  for (const float lower_bound : {0.0f, -5.0f})
  for (const int H : {2, 12}) {
    for (const int D : {16, 128}) {
      SCOPED_TRACE(testing::Message() << "lower_bound " << lower_bound);
      const int64_t rows = 1 + int64_t(rng() % 300), P = int64_t(H) * D;
      std::vector<float> f(static_cast<size_t>(rows * P)), b(static_cast<size_t>(rows * H));
      std::vector<float> dt(static_cast<size_t>(P)), A(static_cast<size_t>(H));
      for (auto& x : f) x = 4.0f * normal(rng);
      for (int i = 0; i < 8 && i < int(f.size()); ++i) f[rng() % f.size()] = 25.0f + normal(rng);  // softplus > 20
      for (auto& x : b) x = 3.0f * normal(rng);
      for (auto& x : dt) x = normal(rng);
      for (auto& x : A) x = normal(rng);
      test::DeviceArray<float> d_f(f), d_b(b), d_dt(dt), d_A(A), d_g(f.size()), d_beta(b.size());
      d_g.poison();
      d_beta.poison();
      kda_gates(d_f.ptr, d_dt.ptr, d_A.ptr, d_b.ptr, d_g.ptr, d_beta.ptr, rows, H, D, lower_bound, nullptr);
      // And in place, as the engine may call it.
      kda_gates(d_f.ptr, d_dt.ptr, d_A.ptr, d_b.ptr, d_f.ptr, d_b.ptr, rows, H, D, lower_bound, nullptr);
      SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> g = d_g.download(), beta = d_beta.download(), g2 = d_f.download(),
                               beta2 = d_b.download();
      int bad = 0;
      for (int64_t i = 0; i < rows * P; ++i) {
        const float x = f[i] + dt[i % P];
        const float a = std::exp(A[(i % P) / D]);
        const float want = lower_bound < 0.0f ? lower_bound / (1.0f + std::exp(-a * x))
                                              : -a * (x > 20.0f ? x : std::log(1.0f + std::exp(x)));
        // expf on the device may be 2 ulp off the host's: log(1 + exp(x)) then differs by a few ulp of 1 when
        // exp(x) is small, so the tolerance has a part scaled by exp(A_log) besides the relative one.
        const double tol = 4e-6 * std::fabs(double(want)) + 5e-7 * std::exp(double(A[(i % P) / D]));
        if (!(std::fabs(double(g[i]) - want) <= tol) || g2[i] != g[i]) {
          if (bad++ < 5)
            ADD_FAILURE() << "H=" << H << " D=" << D << " g[" << i << "] " << g[i] << " (in place " << g2[i]
                          << ") want " << want;
        }
      }
      for (int64_t i = 0; i < rows * H; ++i) {
        const float want = 1.0f / (1.0f + std::exp(-b[i]));
        if (!(std::fabs(beta[i] - want) <= 1e-6f) || beta2[i] != beta[i]) {
          if (bad++ < 10) ADD_FAILURE() << "beta[" << i << "] " << beta[i] << " want " << want;
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fff + ((u >> 16) & 1);
  u &= 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

TEST(CudaKda, GatedRmsNormMatchesCpu) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float eps = 1e-5f;
  for (const int H : {2, 12}) {
    for (const int D : {16, 64, 128}) {
      for (const bool bf16 : {false, true}) {
        const int64_t rows = 1 + int64_t(rng() % 200), P = int64_t(H) * D;
        std::vector<float> o(static_cast<size_t>(rows * P)), gate(o.size()), w(static_cast<size_t>(D));
        for (auto& x : o) x = 2.0f * normal(rng);
        for (auto& x : gate) x = 3.0f * normal(rng);
        for (auto& x : w) x = 1.0f + 0.3f * normal(rng);
        // KdaMixer: ops::rms_norm_ per head (cpu rms_normalize, then * w), then * sigmoid(gate).
        std::vector<float> ref = o;
        for (int64_t grp = 0; grp < rows * H; ++grp) {
          float* r = ref.data() + grp * D;
          double ss = 0;
          for (int i = 0; i < D; ++i) ss += double(r[i]) * r[i];
          const float inv = 1.0f / std::sqrt(float(ss / D) + eps);
          for (int i = 0; i < D; ++i) r[i] *= inv;
          for (int i = 0; i < D; ++i) r[i] *= w[i];
          for (int i = 0; i < D; ++i) r[i] *= 1.0f / (1.0f + std::exp(-gate[grp * D + i]));
        }
        test::DeviceArray<float> d_o(o), d_gate(gate), d_w(w), d_out(o.size());
        d_out.poison();
        kda_gated_rms_norm(d_o.ptr, d_gate.ptr, d_w.ptr, d_out.ptr, bf16, rows, H, D, eps, nullptr);
        SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<float> raw = d_out.download();
        int bad = 0;
        for (int64_t i = 0; i < rows * P; ++i) {
          float got;
          if (bf16) {
            uint16_t bits;
            std::memcpy(&bits, reinterpret_cast<const uint8_t*>(raw.data()) + 2 * i, 2);
            const uint32_t u = uint32_t(bits) << 16;
            std::memcpy(&got, &u, 4);
          } else {
            got = raw[i];
          }
          const float want = bf16 ? bf16_round(ref[i]) : ref[i];
          const double tol = bf16 ? 8e-3 : 2e-6;
          if (!(std::fabs(double(got) - want) <= tol * std::max(1e-2, std::fabs(double(want)))) && bad++ < 5)
            ADD_FAILURE() << "H=" << H << " D=" << D << (bf16 ? " bf16" : " fp32") << " [" << i << "] got " << got
                          << " want " << want;
        }
        EXPECT_EQ(bad, 0);
      }
    }
  }
}

}  // namespace
}  // namespace sparrow::cuda
