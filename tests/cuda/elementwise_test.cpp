// Every launcher of kernels/cuda/elementwise against its CPU twin (cpu::rms_norm, cpu::layer_norm,
// apply_rope_neox / apply_rope_interleaved with Rope::angles, cpu::glu, plain loops), fp32 and
// bf16, several shapes, fresh seeds, outputs poisoned before each launch.
#include <cmath>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "kernels/cpu/reference_ops.h"
#include "kernels/cuda/elementwise/elementwise.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#include "model/rope.h"
#include "gpu_test_util.h"
#include "rt_test_util.h"

namespace sparrow {
namespace {

using cuda::ElemType;
using test::DeviceBuffer;

const char* name(ElemType t) { return t == ElemType::F32 ? "f32" : "bf16"; }

// Host values in `t` on the device, and back.
struct Typed {
  ElemType type;
  std::vector<float> values;  // what the device holds, as fp32 (bf16-rounded for bf16)
  DeviceBuffer buf;
  Typed(ElemType t, std::vector<float> v)
      : type(t), values(round(t, std::move(v))), buf(values.size() * (t == ElemType::F32 ? 4 : 2)) {
    if (t == ElemType::F32) buf.upload(values);
    else buf.upload(test::to_bf16(values));
  }
  static std::vector<float> round(ElemType t, std::vector<float> v) {
    if (t == ElemType::BF16)
      for (float& x : v) x = test::round_bf16(x);
    return v;
  }
  std::vector<float> download() const {
    if (type == ElemType::F32) return buf.download<float>(values.size());
    return test::from_bf16(buf.download<uint16_t>(values.size()));
  }
};

// Expected-vs-got tolerance: fp32 results mirror the CPU's operations (a few ulp at most); a bf16 result
// is one rounding of the fp32 value (half an ulp, 2^-9 relative) plus the input's rounding effects.
::testing::AssertionResult close(ElemType out, const std::vector<float>& got, const std::vector<float>& ref) {
  return out == ElemType::F32 ? test::all_close(got, ref, 4e-6, 1e-6) : test::all_close(got, ref, 1.0 / 128, 1e-6);
}

TEST(CudaElementwise, Convert) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int64_t n : {1, 1000, 300001})
    for (ElemType a : {ElemType::F32, ElemType::BF16})
      for (ElemType b : {ElemType::F32, ElemType::BF16}) {
        SCOPED_TRACE(testing::Message() << n << " " << name(a) << "->" << name(b));
        Typed x(a, test::random_vector(rng, n, -100, 100));
        Typed y(b, std::vector<float>(n, 0.0f));
        y.buf.poison();
        cuda::convert(x.buf.get(), a, y.buf.get(), b, n, cuda::stream());
        std::vector<float> ref = Typed::round(b, x.values);
        std::vector<float> got = y.download();
        EXPECT_TRUE(test::all_close(got, ref, 0, 0));
      }
}

TEST(CudaElementwise, Embedding) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (auto [vocab, width, count] : {std::tuple<int64_t, int64_t, int64_t>{10, 16, 5}, {1000, 7168, 33}, {50, 129, 64}})
    for (ElemType tt : {ElemType::F32, ElemType::BF16})
      for (ElemType ot : {ElemType::F32, ElemType::BF16}) {
        SCOPED_TRACE(testing::Message() << vocab << "x" << width << " " << name(tt) << "->" << name(ot));
        Typed table(tt, test::random_vector(rng, vocab * width));
        std::vector<int32_t> ids(count);
        for (auto& id : ids) id = int32_t(rng() % vocab);
        DeviceBuffer dids(ids);
        Typed out(ot, std::vector<float>(count * width, 0.0f));
        out.buf.poison();
        cuda::embedding(table.buf.get(), tt, dids.get<int32_t>(), count, width, out.buf.get(), ot, cuda::stream());
        Tensor t = Tensor::view(table.values.data(), {vocab, width});
        Tensor ref = cpu::embedding(t, ids);
        std::vector<float> r = Typed::round(ot, std::vector<float>(ref.data(), ref.data() + ref.numel()));
        EXPECT_TRUE(test::all_close(out.download(), r, 0, 0));
      }
}

TEST(CudaElementwise, RmsNormGroupsInPlace) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t rows, first_col, groups, width, extra;
    bool weight, unit_offset;
  };
  const Case cases[] = {{1, 0, 1, 7168, 0, true, false}, {5, 0, 1, 512, 64, true, false},   // MLA kv latent
                        {3, 16, 8, 128, 40, true, true},  {17, 0, 32, 64, 0, false, false},  // per-head norms
                        {2, 0, 1, 1, 0, true, false},     {64, 3, 2, 1536, 5, true, false}};
  for (const Case& c : cases)
    for (ElemType t : {ElemType::F32, ElemType::BF16}) {
      SCOPED_TRACE(testing::Message() << "rows=" << c.rows << " first=" << c.first_col << " groups=" << c.groups
                                      << " width=" << c.width << " " << name(t) << " unit_offset=" << c.unit_offset);
      const int64_t stride = c.first_col + c.groups * c.width + c.extra;
      Typed x(t, test::random_vector(rng, c.rows * stride, -3, 3));
      std::vector<float> w = test::random_vector(rng, c.width, 0.5f, 1.5f);
      DeviceBuffer dw(w);
      cuda::rms_norm(x.buf.get(), t, c.rows, stride, c.first_col, c.groups, c.width,
                     c.weight ? dw.get<float>() : nullptr, 1e-6f, c.unit_offset, cuda::stream());
      // Reference: cpu::rms_norm over the [rows * groups, width] slices; the rest of each row untouched.
      Tensor slices = Tensor::empty({c.rows * c.groups, c.width});
      for (int64_t r = 0; r < c.rows; ++r)
        for (int64_t g = 0; g < c.groups; ++g)
          for (int64_t i = 0; i < c.width; ++i)
            slices.row(r * c.groups + g)[i] = x.values[r * stride + c.first_col + g * c.width + i];
      Tensor wt = Tensor::empty({c.width});
      for (int64_t i = 0; i < c.width; ++i) wt.data()[i] = c.weight ? w[i] : (c.unit_offset ? 0.0f : 1.0f);
      Tensor normed = cpu::rms_norm(slices, wt, 1e-6f, c.unit_offset && c.weight);
      std::vector<float> ref = x.values;
      for (int64_t r = 0; r < c.rows; ++r)
        for (int64_t g = 0; g < c.groups; ++g)
          for (int64_t i = 0; i < c.width; ++i)
            ref[r * stride + c.first_col + g * c.width + i] = normed.row(r * c.groups + g)[i];
      ref = Typed::round(t, ref);
      EXPECT_TRUE(close(t, x.download(), ref));
    }
}

TEST(CudaElementwise, RmsNormRows) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Widths for each launch form: 4 columns a thread (100, 2048), 16 (4096, 6144, 7168), 32 (12000), the loop
  // form (20000).
  for (auto [rows, width] : {std::pair<int64_t, int64_t>{1, 7168}, {33, 4096}, {7, 100}, {128, 2048}, {1, 6144},
                             {3, 12000}, {2, 20000}})
    for (ElemType xt : {ElemType::F32, ElemType::BF16})
      for (ElemType yt : {ElemType::F32, ElemType::BF16})
        for (bool unit : {false, true}) {
          SCOPED_TRACE(testing::Message() << rows << "x" << width << " " << name(xt) << "->" << name(yt)
                                          << " unit=" << unit);
          Typed x(xt, test::random_vector(rng, rows * width, -2, 2));
          Typed y(yt, std::vector<float>(rows * width, 0.0f));
          y.buf.poison();
          std::vector<float> w = test::random_vector(rng, width, -0.5f, 1.5f);
          DeviceBuffer dw(w);
          cuda::rms_norm_rows(x.buf.get(), xt, y.buf.get(), yt, rows, width, dw.get<float>(), 1e-5f, unit,
                              cuda::stream());
          Tensor xv = Tensor::view(x.values.data(), {rows, width}), wv = Tensor::view(w.data(), {width});
          Tensor ref = cpu::rms_norm(xv, wv, 1e-5f, unit);
          std::vector<float> r(ref.data(), ref.data() + ref.numel());
          EXPECT_TRUE(close(yt, y.download(), Typed::round(yt, r)));
        }
}

// add_rms_norm_rows: x += delta rounded to x's type (add()'s values), y = rmsnorm of the rounded rows;
// against the two launches it replaces, bit for bit, and against the CPU.
TEST(CudaElementwise, AddRmsNormRowsIsAddThenNorm) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (auto [rows, width] : {std::pair<int64_t, int64_t>{1, 6144}, {5, 7168}, {16, 2304}, {3, 100}, {2, 20000}})
    for (ElemType t : {ElemType::F32, ElemType::BF16})
      for (bool unit : {false, true}) {
        SCOPED_TRACE(testing::Message() << rows << "x" << width << " " << name(t) << " unit=" << unit);
        const std::vector<float> x0 = test::random_vector(rng, rows * width, -2, 2);
        Typed x(t, x0), x_ref(t, x0), delta(t, test::random_vector(rng, rows * width, -2, 2));
        Typed y(t, std::vector<float>(rows * width, 0.0f)), y_ref(t, std::vector<float>(rows * width, 0.0f));
        y.buf.poison();
        y_ref.buf.poison();
        std::vector<float> w = test::random_vector(rng, width, -0.5f, 1.5f);
        DeviceBuffer dw(w);
        cuda::add_rms_norm_rows(x.buf.get(), delta.buf.get(), t, y.buf.get(), t, rows, width, dw.get<float>(), 1e-6f,
                                unit, cuda::stream());
        cuda::add(delta.buf.get(), t, x_ref.buf.get(), t, rows * width, cuda::stream());
        cuda::rms_norm_rows(x_ref.buf.get(), t, y_ref.buf.get(), t, rows, width, dw.get<float>(), 1e-6f, unit,
                            cuda::stream());
        const std::vector<float> sum = x.download(), normed = y.download();
        EXPECT_EQ(sum, x_ref.download()) << "the sums differ from add()'s";
        EXPECT_EQ(normed, y_ref.download()) << "the norm differs from rms_norm_rows of the sums";
        std::vector<float> expected_sum(x.values.size());
        for (size_t i = 0; i < expected_sum.size(); ++i) expected_sum[i] = x.values[i] + delta.values[i];
        expected_sum = Typed::round(t, expected_sum);
        EXPECT_EQ(sum, expected_sum);
        Tensor ref = cpu::rms_norm(Tensor::view(expected_sum.data(), {rows, width}), Tensor::view(w.data(), {width}),
                                   1e-6f, unit);
        EXPECT_TRUE(close(t, normed, Typed::round(t, std::vector<float>(ref.data(), ref.data() + ref.numel()))));
      }
}

TEST(CudaElementwise, LayerNorm) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (auto [rows, width] : {std::pair<int64_t, int64_t>{1, 128}, {9, 7168}, {40, 333}, {2, 20000}})
    for (ElemType t : {ElemType::F32, ElemType::BF16}) {
      SCOPED_TRACE(testing::Message() << rows << "x" << width << " " << name(t));
      Typed x(t, test::random_vector(rng, rows * width, -1, 3));
      std::vector<float> w = test::random_vector(rng, width, 0.5f, 1.5f), b = test::random_vector(rng, width);
      DeviceBuffer dw(w), db(b);
      cuda::layer_norm(x.buf.get(), t, rows, width, dw.get<float>(), db.get<float>(), 1e-5f, cuda::stream());
      Tensor ref = cpu::layer_norm(Tensor::view(x.values.data(), {rows, width}), Tensor::view(w.data(), {width}),
                                   Tensor::view(b.data(), {width}), 1e-5f);
      EXPECT_TRUE(close(t, x.download(), Typed::round(t, std::vector<float>(ref.data(), ref.data() + ref.numel()))));
    }
}

TEST(CudaElementwise, RopeNeoxAndInterleaved) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t rows, first_col, heads, head_stride, rot, extra;
    bool yarn;
  };
  const Case cases[] = {{1, 0, 1, 64, 64, 0, false},       {5, 512, 1, 64, 64, 0, true},    // MLA k_pe after latent
                        {7, 128, 16, 192, 64, 0, true},     // MLA q: [nope 128 | rope 64] per head
                        {3, 0, 8, 128, 128, 16, false},     {33, 64, 4, 128, 64, 0, false},  // indexer partial
                        {2, 0, 3, 10, 6, 1, false},         {4, 0, 2, 1024, 1024, 0, false},
                        {2, 0, 64, 128, 64, 0, false}};     // MiniMax's queries: heads over 8 blocks a row
  for (const Case& c : cases)
    for (ElemType t : {ElemType::F32, ElemType::BF16})
      for (bool interleaved : {false, true}) {
        SCOPED_TRACE(testing::Message() << "rows=" << c.rows << " heads=" << c.heads << " rot=" << c.rot << " "
                                        << name(t) << (interleaved ? " interleaved" : " neox"));
        nlohmann::json params = {{"rope_theta", 10000.0}};
        if (c.yarn)
          params = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 40.0},
                    {"original_max_position_embeddings", 4096}, {"mscale", 1.0}, {"mscale_all_dim", 0.707},
                    {"beta_fast", 32}, {"beta_slow", 1}};
        Rope rope = Rope::from_config(params, int(c.rot), 163840);
        if (c.yarn) rope.attention_scaling = 1.23f;  // exercise the scaling
        const int64_t stride = c.first_col + (c.heads - 1) * c.head_stride + c.rot + c.extra;
        Typed x(t, test::random_vector(rng, c.rows * stride, -2, 2));
        std::vector<int64_t> pos(c.rows);
        for (auto& p : pos) p = int64_t(rng() % 200000);
        pos[0] = 0;
        DeviceBuffer dpos(pos), dfreq(rope.inv_freq);
        cuda::rope(x.buf.get(), t, c.rows, stride, c.first_col, c.heads, c.head_stride, c.rot, dpos.get<int64_t>(),
                   dfreq.get<float>(), rope.attention_scaling, interleaved, cuda::stream());
        std::vector<float> ref = x.values, cs(c.rot / 2), sn(c.rot / 2);
        for (int64_t r = 0; r < c.rows; ++r) {
          rope.angles(pos[r], cs.data(), sn.data());
          for (int64_t h = 0; h < c.heads; ++h) {
            float* p = ref.data() + r * stride + c.first_col + h * c.head_stride;
            if (interleaved) apply_rope_interleaved(p, cs.data(), sn.data(), int(c.rot));
            else apply_rope_neox(p, cs.data(), sn.data(), int(c.rot));
          }
        }
        // fp32: cos/sin may differ from glibc's by an ulp at large angles; a few ulp of the result.
        std::vector<float> got = x.download();
        ref = Typed::round(t, ref);
        if (t == ElemType::F32) EXPECT_TRUE(test::all_close(got, ref, 2e-5, 2e-6));
        else EXPECT_TRUE(test::all_close(got, ref, 1.0 / 128, 1e-5));
      }
}

// rms_norm_rope_heads: bit for bit the per-head rms_norm launch then the rope launch it replaces, over the
// head widths and rotary dims of the models that call it (MiniMax-M3 q / k: 128 wide, 64 rotated; its MSA
// index heads; Qwen3 drafters: whole heads, NeoX or GPT-J pairs).
TEST(CudaElementwise, RmsNormRopeHeadsIsNormThenRope) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t rows, heads, head_dim, rot;
  };
  const Case cases[] = {{1, 64, 128, 64}, {5, 4, 128, 64}, {3, 1, 128, 128}, {17, 8, 64, 64}, {2, 3, 96, 32}};
  for (const Case& c : cases)
    for (ElemType t : {ElemType::F32, ElemType::BF16})
      for (bool interleaved : {false, true})
        for (bool unit : {false, true}) {
          SCOPED_TRACE(testing::Message() << c.rows << " rows x " << c.heads << " heads of " << c.head_dim
                                          << ", rot " << c.rot << " " << name(t) << (interleaved ? " gpt-j" : " neox")
                                          << " unit=" << unit);
          const std::vector<float> x0 = test::random_vector(rng, c.rows * c.heads * c.head_dim, -3, 3);
          Typed fused(t, x0), separate(t, x0);
          std::vector<float> w = test::random_vector(rng, c.head_dim, 0.5f, 1.5f);
          Rope rope = Rope::from_config({{"rope_theta", 5000000.0}}, int(c.rot), 524288);
          std::vector<int64_t> pos(c.rows);
          for (auto& p : pos) p = int64_t(rng() % 400000);
          DeviceBuffer dw(w), dpos(pos), dfreq(rope.inv_freq);
          cuda::rms_norm_rope_heads(fused.buf.get(), t, c.rows, c.heads, c.head_dim, dw.get<float>(), 1e-6f, unit,
                                    c.rot, dpos.get<int64_t>(), dfreq.get<float>(), 1.0f, interleaved,
                                    cuda::stream());
          cuda::rms_norm(separate.buf.get(), t, c.rows, c.heads * c.head_dim, 0, c.heads, c.head_dim,
                         dw.get<float>(), 1e-6f, unit, cuda::stream());
          cuda::rope(separate.buf.get(), t, c.rows, c.heads * c.head_dim, 0, c.heads, c.head_dim, c.rot,
                     dpos.get<int64_t>(), dfreq.get<float>(), 1.0f, interleaved, cuda::stream());
          EXPECT_EQ(fused.download(), separate.download());
        }
}

TEST(CudaElementwise, AddBiasScale) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (auto [rows, width] : {std::pair<int64_t, int64_t>{1, 1}, {3, 7168}, {100, 129}})
    for (ElemType xt : {ElemType::F32, ElemType::BF16})
      for (ElemType yt : {ElemType::F32, ElemType::BF16}) {
        SCOPED_TRACE(testing::Message() << rows << "x" << width << " " << name(xt) << " " << name(yt));
        const int64_t n = rows * width;
        Typed x(xt, test::random_vector(rng, n)), y(yt, test::random_vector(rng, n));
        cuda::add(x.buf.get(), xt, y.buf.get(), yt, n, cuda::stream());
        std::vector<float> ref(n);
        for (int64_t i = 0; i < n; ++i) ref[i] = y.values[i] + x.values[i];
        std::vector<float> got = y.download();
        EXPECT_TRUE(test::all_close(got, Typed::round(yt, ref), 0, 0)) << "add";
        y.values = Typed::round(yt, ref);
        std::vector<float> bias = test::random_vector(rng, width);
        DeviceBuffer db(bias);
        cuda::add_bias(y.buf.get(), yt, rows, width, db.get<float>(), cuda::stream());
        for (int64_t i = 0; i < n; ++i) ref[i] = y.values[i] + bias[i % width];
        EXPECT_TRUE(test::all_close(y.download(), Typed::round(yt, ref), 0, 0)) << "add_bias";
        y.values = Typed::round(yt, ref);
        cuda::scale(y.buf.get(), yt, n, -0.37f, cuda::stream());
        for (int64_t i = 0; i < n; ++i) ref[i] = y.values[i] * -0.37f;
        EXPECT_TRUE(test::all_close(y.download(), Typed::round(yt, ref), 0, 0)) << "scale";
      }
}

TEST(CudaElementwise, GatedActivations) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (auto [rows, inter] : {std::pair<int64_t, int64_t>{1, 2048}, {17, 100}, {64, 1536}})
    for (ElemType it : {ElemType::F32, ElemType::BF16})
      for (ElemType ot : {ElemType::F32, ElemType::BF16})
        for (auto kind : {Glu::SiluGlu, Glu::ClampedSwiglu, Glu::Situ}) {
          SCOPED_TRACE(testing::Message() << rows << "x" << inter << " " << name(it) << "->" << name(ot) << " kind="
                                          << int(kind));
          Typed gu(it, test::random_vector(rng, rows * 2 * inter, -12, 12));
          Typed out(ot, std::vector<float>(rows * inter, 0.0f));
          out.buf.poison();
          // MiniMax-M3's clamp; SiTU with Kimi K3's kind of bounds (beta 4, linear beta 25: both tanh live).
          const float alpha = kind == Glu::Situ ? 4.0f : 1.702f, limit = kind == Glu::Situ ? 25.0f : 7.0f;
          cuda::glu(gu.buf.get(), it, out.buf.get(), ot, rows, inter, kind, alpha, limit, cuda::stream());
          std::vector<float> ref(rows * inter);
          for (int64_t r = 0; r < rows; ++r) {
            const float* gate = gu.values.data() + r * 2 * inter;
            cpu::glu(kind, gate, gate + inter, ref.data() + r * inter, inter, alpha, limit);
          }
          ref = Typed::round(ot, ref);
          // expf may differ from glibc's by an ulp or two.
          if (ot == ElemType::F32) EXPECT_TRUE(test::all_close(out.download(), ref, 1e-5, 1e-6));
          else EXPECT_TRUE(test::all_close(out.download(), ref, 1.0 / 128, 1e-6));
        }
}

TEST(CudaElementwise, GatherRows) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (auto [rows, width, count] : {std::tuple<int64_t, int64_t, int64_t>{10, 7, 4}, {300, 7168, 77}, {5, 1, 9}})
    for (ElemType t : {ElemType::F32, ElemType::BF16}) {
      SCOPED_TRACE(testing::Message() << rows << "x" << width << " count " << count << " " << name(t));
      Typed x(t, test::random_vector(rng, rows * width));
      std::vector<int32_t> index(count);
      for (auto& i : index) i = int32_t(rng() % rows);
      DeviceBuffer di(index);
      Typed out(t, std::vector<float>(count * width, 0.0f));
      out.buf.poison();
      cuda::gather_rows(x.buf.get(), t, di.get<int32_t>(), count, width, out.buf.get(), cuda::stream());
      std::vector<float> ref(count * width);
      for (int64_t i = 0; i < count; ++i)
        for (int64_t c = 0; c < width; ++c) ref[i * width + c] = x.values[index[i] * width + c];
      EXPECT_TRUE(test::all_close(out.download(), ref, 0, 0));
    }
}

}  // namespace
}  // namespace sparrow
