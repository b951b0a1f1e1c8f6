"""scripts/anchors_report.py: issue 3's must-hold read off the anchors step's bench results,
against the reference table of BENCHMARKS.md (parsed, so that the two cannot drift apart)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import anchors_report as report  # noqa: E402

H100 = report.ANCHORS_CARD


def bench_doc(kind: str, model: str, rows: list[tuple], device: str = H100) -> dict:
    """A bench.json as `moekit bench` writes it (the fields the report reads): rows of
    (backend, chosen, M, median_us, efficiency)."""
    return {"metadata": {"device": device, "mode": kind},
            "rows": [{"model": model, "backend": b, "chosen": c, "mode": kind, "batch_size": m, "median_us": us,
                      "efficiency": eff} for b, c, m, us, eff in rows]}


def write(results: Path, mode: str, kind: str, model: str, rows: list[tuple], device: str = H100) -> None:
    folder = results / f"anchors-{mode}-{kind}-{model}"
    folder.mkdir(parents=True)
    (folder / "bench.json").write_text(json.dumps(bench_doc(kind, model, rows, device)))


def test_the_reference_table_of_benchmarks_md_is_read_whole():
    points = report.reference_points()
    assert len(points) == 21 and {m for m, _ in points} == set(report.MODELS.values())
    glm1 = points[("glm-4.5v-fp8", 1)]
    assert (glm1["floor_us"], glm1["vllm_us"]) == (23.1, 40.9)
    assert glm1["vllm_eff"] == pytest.approx(23.1 / 40.9)  # from floor and time, not the rounded 0.56
    assert points[("deepseek-v3", 8192)]["vllm_us"] == 1963.6


def test_a_point_is_judged_by_efficiency_and_the_layer_by_time(tmp_path, capsys):
    # GLM-4.5V M = 1: vLLM 40.9 µs at 23.1 / 40.9 = 0.565; M = 8: 165.7 µs at 0.871
    write(tmp_path, "precise", "gemm", "glm-4.5v-fp8", [("triton", "triton", 1, 39.0, 0.59),
                                                        ("triton", "triton", 8, 170.0, 0.85)])
    write(tmp_path, "precise", "layer", "glm-4.5v-fp8", [("triton", "triton", 1, 40.9, 0.565),
                                                         ("auto", "triton", 1, 41.0, 0.56),
                                                         ("triton", "triton", 8, 180.0, 0.81)])
    assert report.main([str(tmp_path), "--markdown", str(tmp_path / "r.md"), "--json", str(tmp_path / "r.json")]) == 0
    records = {r["M"]: r for r in json.loads((tmp_path / "r.json").read_text())["records"]}
    assert set(records) == {1, 8}  # only the points the results cover
    one, eight = records[1], records[8]
    assert one["gemms_hold"] and one["gemms_vs_vllm"] == pytest.approx(39.0 / 40.9)
    assert one["layer_hold"]  # 40.9 against 40.9: no longer
    assert one["aim"] == 0.8 and one["aim_met"] is False and one["auto_ran"] == "triton"
    assert not eight["gemms_hold"] and not eight["layer_hold"] and eight["aim_met"] is True
    md = (tmp_path / "r.md").read_text()
    assert ("| glm-4.5v-fp8 | 1 | 40.9 | 39.0 | 0.95 | 0.59 (0.56) ok | 40.9 | 1.00 ok | 1.00 ok | 0.56 (0.8) no "
            "| triton 41.0 |") in md
    assert "- GEMMs at least as efficient as vLLM's: 1 of 2 points" in md
    assert "- whole layer no longer than vLLM's two GEMMs: 1 of 2 points" in md
    # for the same bytes: M = 1's layer at 0.565 against vLLM's 23.1 / 40.9 = 0.5648 (just shorter);
    # M = 8's at 0.81 against vLLM's 0.871 (longer)
    reference = report.reference_points()
    assert one["layer_vs_vllm_same_bytes"] == pytest.approx(reference[("glm-4.5v-fp8", 1)]["vllm_eff"] / 0.565)
    assert one["layer_hold_same_bytes"] is True
    assert eight["layer_vs_vllm_same_bytes"] == pytest.approx(reference[("glm-4.5v-fp8", 8)]["vllm_eff"] / 0.81)
    assert eight["layer_hold_same_bytes"] is False
    assert "- whole layer no longer than vLLM's two GEMMs for the same bytes (vLLM's efficiency over the layer's): " \
        "1 of 2 points" in md
    out = capsys.readouterr()
    assert "1 of 2 points" in out.out and "warning" not in out.err


def test_a_later_folder_replaces_an_earlier_ones_model_and_another_card_is_said(tmp_path, capsys):
    first, second = tmp_path / "call1", tmp_path / "call2"
    write(first, "precise", "gemm", "mixtral-8x7b", [("triton", "triton", 1, 200.0, 0.6)])
    write(second, "precise", "gemm", "mixtral-8x7b", [("triton", "triton", 1, 140.0, 0.84)], device="NVIDIA H200")
    write(second, "fast", "gemm", "mixtral-8x7b", [("triton", "triton", 1, 1.0, 99.0)])  # another mode: not read
    assert report.main([str(first), str(second), "--json", str(tmp_path / "r.json")]) == 0
    (record,) = json.loads((tmp_path / "r.json").read_text())["records"]
    assert record["gemms_us"] == 140.0 and record["gemms_hold"] and record["layer_us"] is None
    # the replaced file's card is not counted: only the results reported
    assert "warning: measured on NVIDIA H200;" in capsys.readouterr().err


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "no anchors-precise-gemm-<model>/bench.json"),
    (lambda d: (d / "anchors-precise-gemm-glm-4.5v-fp8").mkdir() or
     (d / "anchors-precise-gemm-glm-4.5v-fp8" / "bench.json").write_text("{not json"), "not a moekit bench result"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, message):
    setup(tmp_path)
    assert report.main([str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert report.main([str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_results_timed_after_another_flush_are_refused(tmp_path, capsys):
    """The reference points were timed after zeroing the flush buffer: a bench run with
    --l2-flush read (6-10 µs less per decode replay on an H100) is not compared with them; a run
    that names zero, or one from before the option (no field), is."""
    rows = [("triton", None, 1, 44.0, 0.5)]
    write(tmp_path / "zero", "precise", "gemm", "glm-4.5v-fp8", rows)
    write(tmp_path / "read", "precise", "gemm", "glm-4.5v-fp8", rows)
    for folder, flush in (("zero", "zero"), ("read", "read")):
        f = tmp_path / folder / "anchors-precise-gemm-glm-4.5v-fp8" / "bench.json"
        doc = json.loads(f.read_text())
        doc["metadata"]["l2_flush"] = flush
        f.write_text(json.dumps(doc))
    assert report.main([str(tmp_path / "zero")]) == 0
    capsys.readouterr()
    assert report.main([str(tmp_path / "read")]) == 2
    assert "timed with --l2-flush read" in capsys.readouterr().err


def test_a_reference_row_of_an_unknown_model_is_refused(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text("## Reference points\n\n| model | M | floor | vllm | cutlass |\n|---|\n| Qwen9 | 1 | 1.0 | 2.0 (0.50) | n/a |\n")
    with pytest.raises(report.ReportError, match="unknown model 'Qwen9'"):
        report.reference_points(doc)
