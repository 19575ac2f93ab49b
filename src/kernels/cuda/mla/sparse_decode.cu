// Sparse MLA attention (DeepSeek-V3.2 DSA / Kimi K3): each query row attends to its top-k selected
// tokens: the warpgroup kernel (wgmma_kernel.cuh) or attention_kernel.cuh (mla_sparse_kernel_for says which),
// keys gathered through the index list.
#include "kernels/cuda/mla/attention_kernel.cuh"

namespace sparrow::cuda {

namespace mla_detail {
void dispatch_sparse(const AttnPlan& plan, PageFormat format, const AttnParams& p, cudaStream_t stream) {
  dispatch_mla_attention<true>(plan, format, p, stream);
}
}  // namespace mla_detail

void mla_sparse_attention(const MlaPagedCache& cache, const uint16_t* q, const int32_t* row_seq,
                          const int32_t* indices, int64_t rows, int heads, int topk, float softmax_scale,
                          uint16_t* out, float* lse, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream, MlaKernel kernel) {
  SPARROW_CHECK(topk > 0, "mla sparse attention: topk must be positive, got ", topk);
  SPARROW_CHECK(rows == 0 || indices, "mla sparse attention: null indices");
  mla_detail::launch_mla_attention(cache, q, row_seq, indices, nullptr, rows, heads, topk, topk, softmax_scale, out,
                                   lse, workspace, workspace_bytes, stream,
                                   (kernel == MlaKernel::Auto ? mla_sparse_kernel_for(heads) : kernel) == MlaKernel::Wgmma);
}

}  // namespace sparrow::cuda
