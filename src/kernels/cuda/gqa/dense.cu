// Dense causal GQA attention: the kernel of attention_kernel.cuh instantiated for every head_dim bucket and
// K/V page format.
#include "kernels/cuda/gqa/attention_kernel.cuh"

namespace sparrow::cuda::gqa_detail {

template void dispatch_gqa<false>(int, PageFormat, const GqaParams&, size_t, unsigned, unsigned, cudaStream_t);

}  // namespace sparrow::cuda::gqa_detail
