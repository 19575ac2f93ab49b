// Dense causal GQA attention: the kernel of attention_kernel.cuh instantiated for every head_dim bucket and
// K/V page format.
#include "kernels/cuda/gqa/attention_kernel.cuh"

namespace sparrow::cuda::gqa_detail {

template <GqaKvFormat F>
void dispatch_dense_format(int dmax, const GqaParams& p, size_t smem, unsigned grid_x, unsigned grid_y,
                           cudaStream_t stream) {
  switch (dmax) {
    case 16: return launch_gqa_variant<16, false, F>(p, smem, grid_x, grid_y, stream);
    case 32: return launch_gqa_variant<32, false, F>(p, smem, grid_x, grid_y, stream);
    case 64: return launch_gqa_variant<64, false, F>(p, smem, grid_x, grid_y, stream);
    case 128: return launch_gqa_variant<128, false, F>(p, smem, grid_x, grid_y, stream);
    default: return launch_gqa_variant<256, false, F>(p, smem, grid_x, grid_y, stream);
  }
}

void dispatch_dense(int dmax, GqaKvFormat format, const GqaParams& p, size_t smem, unsigned grid_x, unsigned grid_y,
                    cudaStream_t stream) {
  switch (format) {
    case GqaKvFormat::BFloat16:
      return dispatch_dense_format<GqaKvFormat::BFloat16>(dmax, p, smem, grid_x, grid_y, stream);
    case GqaKvFormat::Fp8: return dispatch_dense_format<GqaKvFormat::Fp8>(dmax, p, smem, grid_x, grid_y, stream);
    case GqaKvFormat::Nvfp4: return dispatch_dense_format<GqaKvFormat::Nvfp4>(dmax, p, smem, grid_x, grid_y, stream);
  }
}

}  // namespace sparrow::cuda::gqa_detail
