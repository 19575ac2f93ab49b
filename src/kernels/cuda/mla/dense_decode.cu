// Dense MLA attention (decode over the whole causal prefix, DeepSeek-V3 / Kimi Linear style, or a DSA
// model's short-context path): row t attends to tokens 0..row_lens[t]-1. Long contexts are split across
// blocks (flash-decoding) and merged by the combine kernel of attention_launch.cu.
#include "kernels/cuda/mla/attention_kernel.cuh"

namespace sparrow::cuda {

namespace mla_detail {
void dispatch_dense(const AttnPlan& plan, PageFormat format, const AttnParams& p, cudaStream_t stream) {
  dispatch_mla_attention<false>(plan, format, p, stream);
}
}  // namespace mla_detail

void mla_dense_attention(const MlaPagedCache& cache, const uint16_t* q, const int32_t* row_seq,
                         const int32_t* row_lens, int64_t rows, int heads, int64_t max_len, float softmax_scale,
                         uint16_t* out, float* lse, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  SPARROW_CHECK(rows == 0 || row_lens, "mla dense attention: null row_lens");
  mla_detail::launch_mla_attention(cache, q, row_seq, nullptr, row_lens, rows, heads, max_len, 0, softmax_scale, out,
                                   lse, workspace, workspace_bytes, stream, /*wgmma=*/false);
}

}  // namespace sparrow::cuda
