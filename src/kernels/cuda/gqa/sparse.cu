// Block-sparse (MSA) GQA attention: the kernel of attention_kernel.cuh instantiated for every head_dim bucket.
#include "kernels/cuda/gqa/attention_kernel.cuh"

namespace sparrow::cuda::gqa_detail {

void dispatch_sparse(int dmax, const GqaParams& p, size_t smem, unsigned grid_x, unsigned grid_y, cudaStream_t stream) {
  switch (dmax) {
    case 16: return launch_gqa_variant<16, true>(p, smem, grid_x, grid_y, stream);
    case 32: return launch_gqa_variant<32, true>(p, smem, grid_x, grid_y, stream);
    case 64: return launch_gqa_variant<64, true>(p, smem, grid_x, grid_y, stream);
    case 128: return launch_gqa_variant<128, true>(p, smem, grid_x, grid_y, stream);
    default: return launch_gqa_variant<256, true>(p, smem, grid_x, grid_y, stream);
  }
}

}  // namespace sparrow::cuda::gqa_detail
