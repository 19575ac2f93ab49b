"""Tests for tools/kernel_table.py on made-up benchmark lines: python3 -m pytest tests/kernel_table_test.py"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import kernel_table  # noqa: E402


def write(path, rows, extra=""):
    path.write_text(extra + "".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def table_rows(text):
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| kernel") and not line.startswith("| ---")]


def test_merges_sparrow_and_peers(tmp_path, capsys):
    sparrow = write(tmp_path / "sparrow.jsonl", [
        # 4.3e9 bytes in 2000 us = 2.15 TB/s = 50% of HBM.
        {"kernel": "sparse_mla_decode", "shape": "deepseek_v3.2 heads=128 ctx=8192 batch=1 q=1 topk=2048 fp8",
         "impl": "sparrow", "median_us": 2000.0, "bytes": 4.3e9, "flops": 1e9, "note": "fp8 kv"},
        # FLOP-bound: 7.9e12 flops in 20000 us = 395 TFLOP/s = 50% of bf16 (note says fp8 storage only).
        {"kernel": "dense_mla_decode", "shape": "kimi_k3.1_pro heads=96 ctx=32768 batch=64 q=2 topk=2048 bf16",
         "impl": "sparrow", "median_us": 20000.0, "bytes": 1e6, "flops": 7.9e12, "note": "bf16"},
        {"kernel": "sparse_mla_prefill", "shape": "deepseek_v3.2 heads=128 ctx=8192 batch=1 q=4096 topk=2048 bf16",
         "impl": "sparrow", "median_us": 10000.0, "bytes": 0, "flops": 7.9e12, "note": "fp8 mma"},
        # The field decides over the note: FP8 products whatever the note says, and bf16 ones although it
        # mentions fp8 tensor cores.
        {"kernel": "dsa_index_scores", "shape": "deepseek_v3.2 heads=64 ctx=8192 batch=64 q=1",
         "impl": "sparrow", "median_us": 10000.0, "bytes": 0, "flops": 7.9e12, "fp8_products": True, "note": "wgmma"},
        {"kernel": "dsa_index_scores", "shape": "deepseek_v3.2 heads=64 ctx=8192 batch=128 q=1",
         "impl": "sparrow", "median_us": 10000.0, "bytes": 0, "flops": 7.9e12, "fp8_products": False,
         "note": "keys widened to f16, not fp8 tensor cores"},
    ], extra="# a comment line\nnot json\n")
    torch_ = write(tmp_path / "torch_mla.jsonl", [
        {"kernel": "sparse_mla_decode", "shape": "deepseek_v3.2 heads=128 ctx=8192 batch=1 q=1 topk=2048 fp8",
         "impl": "torch", "median_us": 5000.0, "note": ""},
        {"kernel": "sparse_mla_decode", "shape": "deepseek_v3.2 heads=128 ctx=8192 batch=1 q=1 topk=2048 fp8",
         "impl": "torch_compile", "median_us": 4000.0, "note": ""},
    ])
    flash = write(tmp_path / "flashmla.jsonl", [
        {"kernel": "sparse_mla_decode", "shape": "deepseek_v3.2 heads=128 ctx=8192 batch=1 q=1 topk=2048 fp8",
         "impl": "flashmla", "median_us": 1000.0, "note": ""},
        # Dense shape without topk= still matches sparrow's row.
        {"kernel": "dense_mla_decode", "shape": "kimi_k3.1_pro heads=96 ctx=32768 batch=64 q=2 bf16",
         "impl": "flashmla", "median_us": 40000.0, "note": ""},
        # Failed measurement, and a shape sparrow did not run.
        {"kernel": "sparse_mla_decode", "shape": "kimi_k3.1_pro_tp8 heads=12 ctx=8192 batch=1 q=1 topk=2048 fp8",
         "impl": "flashmla", "median_us": None, "note": "failed"},
    ])
    assert kernel_table.main([sparrow, torch_, flash]) == 0
    out = capsys.readouterr().out
    rows = {(r[0], r[1]): r for r in table_rows(out)}
    assert len(rows) == 6

    r = rows[("sparse_mla_decode", "deepseek_v3.2 heads=128 ctx=8192 batch=1 q=1 topk=2048 fp8")]
    assert r[2] == "2000" and r[3] == "2.15" and r[5] == "50.0%"
    assert r[6] == "4000"          # fastest torch impl
    assert r[7] == "1000"
    assert r[8] == "0.50x"         # best peer (flashmla 1000) / sparrow 2000

    r = rows[("dense_mla_decode", "kimi_k3.1_pro heads=96 ctx=32768 batch=64 q=2 topk=2048 bf16")]
    assert r[4] == "395" and r[5] == "50.0%" and r[7] == "40000" and r[8] == "2.00x" and r[6] == ""

    r = rows[("sparse_mla_prefill", "deepseek_v3.2 heads=128 ctx=8192 batch=1 q=4096 topk=2048 bf16")]
    assert r[5] == "50.0%"         # note says fp8 mma: compared with the 1580 TFLOP/s peak

    assert rows[("dsa_index_scores", "deepseek_v3.2 heads=64 ctx=8192 batch=64 q=1")][5] == "50.0%"
    assert rows[("dsa_index_scores", "deepseek_v3.2 heads=64 ctx=8192 batch=128 q=1")][5] == "100%"

    r = rows[("sparse_mla_decode", "kimi_k3.1_pro_tp8 heads=12 ctx=8192 batch=1 q=1 topk=2048 fp8")]
    assert r[2] == "" and r[7] == "fail" and r[8] == ""


def test_rows_sorted_numerically(tmp_path):
    rows = [{"kernel": "k", "shape": f"m heads=8 ctx={c} batch={b}", "impl": "sparrow", "median_us": 1.0}
            for c in (131072, 8192) for b in (128, 2, 16)]
    lines, _ = kernel_table.build_table(rows)
    shapes = [r[1] for r in table_rows("\n".join(lines))]
    assert shapes == [f"m heads=8 ctx={c} batch={b}" for c in (8192, 131072) for b in (2, 16, 128)]
