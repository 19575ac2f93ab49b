"""How every peer script times a launch, as sparrow's median_launch_us does (kernels/cuda/kernel_bench.h):
three warm-up calls, then the median of `iters` calls timed with CUDA events, the L2 flushed before
each (a 256 MiB write) so nothing of the previous call is cached."""
import os

import torch

_FLUSH = None
# SPARROW_BENCH_FLUSH=read: flush by reading the buffer (clean L2 lines) rather than writing it, as
# median_launch_us does under the same variable (an experiment on the timing floor, kernels.md).
_READ_FLUSH = os.environ.get("SPARROW_BENCH_FLUSH") == "read"


def median_us(fn, iters):
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        if _READ_FLUSH:
            _FLUSH.view(torch.int32).sum()
        else:
            _FLUSH.fill_(i & 0xFF)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    times.sort()
    return times[len(times) // 2]
