// Build-time stand-ins for FlashMLA's SM100 (Blackwell) entry points.
//
// FlashMLA's setup.py compiles every SM100 translation unit even with FLASH_MLA_DISABLE_SM100=1
// (that flag only drops the sm_100f gencode); their device code is then #if'd out, but the host
// side still instantiates heavy CUTLASS templates, which dominates the build on the H200 box.
// bench/peers/build_flashmla.sh swaps those units for this file. The API layer only reaches these
// symbols when the GPU reports compute capability 10.x, so on Hopper they are never called; if
// they ever are, they fail loudly instead of computing garbage.
//
// This is sparrow's own file (not FlashMLA code): it only defines the symbols FlashMLA's API
// (csrc/api/*.h) declares, with bodies that throw. It is compiled only inside the FlashMLA build.
#include "api/common.h"
#include "params.h"
#include "sm100/decode/head64/kernel.h"
#include "sm100/prefill/dense/interface.h"
#include "sm100/prefill/sparse/fwd/head128/phase1.h"
#include "sm100/prefill/sparse/fwd/head64/phase1.h"
#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"

namespace {
[[noreturn]] void sm100_not_built(const char* what) {
    TORCH_CHECK(false, "FlashMLA was built for sm_90a only (sparrow bench/peers/build_flashmla.sh); ", what,
                " needs the SM100 kernels. Rebuild with FLASHMLA_FULL=1.");
}
}  // namespace

void FMHACutlassSM100FwdRun(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                            at::Tensor, int, float, int, int, bool) {
    sm100_not_built("dense_prefill_fwd");
}

void FMHACutlassSM100BwdRun(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                            at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int, float, int, int, bool) {
    sm100_not_built("dense_prefill_bwd");
}

namespace sm100::decode::head64 {
template <>
void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32>(const SparseAttnDecodeParams&) {
    sm100_not_built("sm100 sparse decode (V32)");
}
template <>
void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1>(const SparseAttnDecodeParams&) {
    sm100_not_built("sm100 sparse decode (MODEL1)");
}
}  // namespace sm100::decode::head64

namespace sm100::fwd::head64 {
template <>
void run_fwd_phase1_kernel<512>(const SparseAttnFwdParams&) { sm100_not_built("sm100 sparse prefill h64 k512"); }
template <>
void run_fwd_phase1_kernel<576>(const SparseAttnFwdParams&) { sm100_not_built("sm100 sparse prefill h64 k576"); }
}  // namespace sm100::fwd::head64

namespace sm100::fwd::head128 {
template <>
void run_fwd_phase1_kernel<512>(const SparseAttnFwdParams&) { sm100_not_built("sm100 sparse prefill h128 k512"); }
template <>
void run_fwd_phase1_kernel<576>(const SparseAttnFwdParams&) { sm100_not_built("sm100 sparse prefill h128 k576"); }
}  // namespace sm100::fwd::head128

namespace sm100::fwd_for_small_topk::head128 {
template <>
void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::Prefill, 512>(const SparseAttnFwdParams&) {
    sm100_not_built("sm100 small-topk sparse prefill");
}
template <>
void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::DecodeWithSplitKV, 512>(const SparseAttnDecodeParams&) {
    sm100_not_built("sm100 small-topk sparse decode");
}
}  // namespace sm100::fwd_for_small_topk::head128
