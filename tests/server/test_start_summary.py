"""sparrow serve's start-up summary: one block on stderr once the model is loaded (serve_command.cpp
print_start_summary): what is served, its architecture, weights, parallel layout, KV cache, max_model_len
and CUDA graphs."""
from __future__ import annotations

import re

from sparrow_server import MODEL_NAME, wait_until


def test_start_summary_block(server, model_dir):
    # stderr is read by its own thread, which may lag behind the start-up line on stdout.
    assert wait_until(lambda: any("CUDA graphs" in line for line in server.stderr), timeout_s=10)
    err = "".join(server.stderr)
    block = [line for line in err.splitlines() if line.startswith(("sparrow serve: ", "kv cache: "))]
    text = "\n".join(block)
    assert f"sparrow serve: model {model_dir}, served as '{MODEL_NAME}'" in text
    assert re.search(r"sparrow serve: architecture deepseek_v32 \(\w+\), \d+ layers, vocabulary \d+", text), text
    assert "sparrow serve: weights computed in float32 on the CPU; checkpoint quantization: none" in text
    assert "sparrow serve: parallel layout: one process (tensor parallel 1)" in text
    assert re.search(r"kv cache: .* holds [\d,]+ block rows of [\d,]+ bytes = [\d,]+ tokens", text), text
    assert "sparrow serve: max_model_len 256" in text
    assert "sparrow serve: CUDA graphs: off (the CPU backend)" in text
    # One block, in this order, before the server says it listens (on stdout).
    order = ["model ", "architecture ", "weights ", "parallel layout", "kv cache: ", "max_model_len", "CUDA graphs"]
    positions = [next(i for i, line in enumerate(block) if key in line) for key in order]
    assert positions == sorted(positions), block
