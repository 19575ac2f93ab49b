// The gated activations (kernels/glu.h) for one (gate, up) pair, as cpu::glu computes them
// (src/kernels/cpu/reference_ops.cpp), with explicit rounding so that no product fuses into an FMA the CPU
// does not make. Used by the elementwise glu and the MoE experts' epilogue.
#pragma once
#include "kernels/glu.h"

namespace sparrow::cuda {

__device__ __forceinline__ float glu_value(float g, float u, Glu kind, float alpha, float limit) {
  if (kind == Glu::SiluGlu) return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
  if (kind == Glu::Situ) {
    const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
    const float uu = limit > 0.0f ? __fmul_rn(limit, tanhf(__fdiv_rn(u, limit))) : u;
    return __fmul_rn(__fmul_rn(__fmul_rn(alpha, tanhf(__fdiv_rn(g, alpha))), sig), uu);
  }
  const float gc = fminf(g, limit), uc = fminf(fmaxf(u, -limit), limit);
  const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-__fmul_rn(gc, alpha))));
  return __fmul_rn(__fadd_rn(uc, 1.0f), __fmul_rn(gc, sig));
}

}  // namespace sparrow::cuda
