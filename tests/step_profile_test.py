"""Tests for tools/step_profile.py on made-up ncu CSV: python3 -m pytest tests/step_profile_test.py"""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import step_profile  # noqa: E402

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')


def launch(i, name, ns, unit="ns", metric="gpu__time_duration.sum", grid="(1, 1, 1)"):
    return (f'"{i}","1","sparrow","h","{name}","1","13","(128, 1, 1)","{grid}","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{ns}"\n')


EMBED = "void sparrow::<unnamed>::embedding_kernel<__nv_bfloat16, __nv_bfloat16>(const T1 *, const int *, long, T2 *)"
NORM16 = "void sparrow::<unnamed>::rms_norm_kernel<__nv_bfloat16, __nv_bfloat16, 16>(const T1 *, long)"
NORM4 = "void sparrow::<unnamed>::rms_norm_kernel<__nv_bfloat16, __nv_bfloat16, 4>(const T1 *, long)"
SKINNY = "void skinny::kernel<sparrow::DenseJob<1>, 1, 1>(T1)"
COMBINE = "mla_detail::mla_combine_kernel(const float *, const float *, int, long, __nv_bfloat16 *, float *)"


def ncu_file(tmp_path, name, rows):
    # What `ncu --csv ... sparrow bench forward` leaves in the file: the benchmark's JSON line, ncu's own lines,
    # then the CSV.
    text = '{"batch":1,"decode_step_ms":1.0}\n==PROF== Disconnected\n' + HEADER
    text += "".join(launch(i, *row) for i, row in enumerate(rows))
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_base_names():
    assert step_profile.base_name(NORM16) == "rms_norm_kernel"
    assert step_profile.base_name(SKINNY) == "skinny::kernel"
    assert step_profile.base_name(COMBINE) == "mla_detail::mla_combine_kernel"
    assert step_profile.base_name("nvjet_sm90_tst_128x8_64x12_1x1_h_bz_TNT") == "nvjet_sm90_tst_128x8_64x12_1x1_h_bz_TNT"
    assert step_profile.base_name("void sparrow::cuda::(anonymous namespace)::f<int>(int)") == "f"


def test_last_step_grouped(tmp_path, capsys):
    path = ncu_file(tmp_path, "a.csv", [
        (EMBED, "9,000"), (NORM16, "50,000"),  # the prefill: left out
        (EMBED, "8,000"), (NORM16, "4,000"), (SKINNY, "1,000"),
        (EMBED, "8,500"), (NORM16, "11,500"), (NORM4, "5,000"), (SKINNY, "40,000"), (SKINNY, "2,000"),
        (COMBINE, "10", "us"),
        (NORM16, "123", "ns", "sm__cycles_elapsed.avg"),  # another metric: ignored
    ])
    step_profile.main([path])
    out = capsys.readouterr().out
    rows = {r[0]: r[1:] for r in ([c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()[2:])}
    assert rows["skinny::kernel"] == ["2", "42.0"]
    assert rows["rms_norm_kernel"] == ["2", "16.5"]  # both instantiations, one row
    assert rows["mla_detail::mla_combine_kernel"] == ["1", "10.0"]
    assert rows["embedding_kernel"] == ["1", "8.5"]
    assert rows["**step**"] == ["6", "77.0"]
    # Sorted by time: the products first.
    assert out.splitlines()[2].startswith("| skinny::kernel |")


def test_two_builds_and_jsonl(tmp_path, capsys):
    before = ncu_file(tmp_path, "before.csv", [(EMBED, "8,000"), (NORM16, "12,000"), (SKINNY, "40,000")])
    after = ncu_file(tmp_path, "after.csv", [(EMBED, "8,000"), (NORM16, "4,000"), (SKINNY, "41,000", "ns",
                                                                                      "gpu__time_duration.sum", "(1, 64, 1)")])
    raw = tmp_path / "raw.jsonl"
    step_profile.main([before, after, "--jsonl", str(raw), "--meta", "gpu=H100", "--meta", "commit=abc"])
    out = capsys.readouterr().out
    assert "| rms_norm_kernel | 1 | 12.0 | 1 | 4.0 | -8.0 |" in out
    assert "| skinny::kernel | 1 | 40.0 | 1 | 41.0 | +1.0 |" in out
    assert "| **step** | 3 | 60.0 | 3 | 53.0 | -7.0 |" in out
    lines = [json.loads(l) for l in raw.read_text().splitlines()]
    assert lines[0]["meta"]["gpu"] == "H100" and lines[0]["meta"]["commit"] == "abc"
    assert [l["kernel"] for l in lines[1:]] == [EMBED, NORM16, SKINNY]  # the first file's step, full names
    assert lines[2]["us"] == 12.0


def test_errors(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("not a csv\n")
    with pytest.raises(ValueError, match="no ncu CSV header"):
        step_profile.main([str(empty)])
    no_embedding = ncu_file(tmp_path, "x.csv", [(NORM16, "1,000")])
    with pytest.raises(ValueError, match="no embedding_kernel launch"):
        step_profile.main([no_embedding])
    seconds = ncu_file(tmp_path, "s.csv", [(EMBED, "1", "second")])
    with pytest.raises(ValueError, match="unknown time unit"):
        step_profile.main([seconds])
