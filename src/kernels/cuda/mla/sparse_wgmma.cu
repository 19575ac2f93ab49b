// Sparse MLA attention on the warpgroup kernel (wgmma_kernel.cuh), one instantiation per cache format.
#include "kernels/cuda/mla/wgmma_kernel.cuh"

namespace sparrow::cuda::mla_detail::wg {

void dispatch_sparse_wgmma(PageFormat format, const AttnParams& p, cudaStream_t stream) {
  switch (format) {
    case PageFormat::Fp8Latent: return launch_wgmma<PageFormat::Fp8Latent, true>(p, stream);
    case PageFormat::BFloat16: return launch_wgmma<PageFormat::BFloat16, true>(p, stream);
    case PageFormat::Fp8Rows: return launch_wgmma<PageFormat::Fp8Rows, true>(p, stream);
    case PageFormat::Nvfp4Latent: return launch_wgmma<PageFormat::Nvfp4Latent, true>(p, stream);
    default: break;
  }
  fail("mla attention: unknown cache format ", int(format));
}

}  // namespace sparrow::cuda::mla_detail::wg
