"""`moekit eval` end to end on a tiny FP8 model with its tokenizer."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("compressed_tensors")

from moekit.cli import main  # noqa: E402
from moekit.hf.eval import DEFAULT_TEXT  # noqa: E402

from test_hf_tiny import fp8_checkpoint, tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out, _ = fp8_checkpoint(tmp_path_factory, "mixtral")
    tiny_tokenizer(DEFAULT_TEXT.read_text()).save_pretrained(out)
    return out


def test_eval_writes_report(model_dir, tmp_path):
    out = tmp_path / "report.json"
    rc = main(["eval", "--model", str(model_dir), "--backends", "torch", "--max-tokens", "80",
               "--seq-len", "40", "--gen-tokens", "4", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["scheme"] == "fp8-channel-token" and report["positions_scored"] == 79  # every next token of the 80
    assert list(report["backends"]) == ["reference", "torch"]
    ref, tor = report["backends"]["reference"], report["backends"]["torch"]
    assert ref["kl_mean_vs_reference"] == 0 and ref["top1_agreement_vs_reference"] == 1
    assert 0 < tor["kl_mean_vs_reference"] < 0.05 and tor["top1_agreement_vs_reference"] >= 0.75
    for r in (ref, tor):
        assert 1 < r["perplexity"] < 10_000 and r["tokens_per_s"] > 0 and len(r["generated"]) == 4
    assert report["pairwise"]["reference|torch"]["top1_agreement"] == tor["top1_agreement_vs_reference"]
    assert report["experts_bytes"] > 0


def test_eval_bad_input(model_dir, tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "nowhere")]) == 2
    assert "not a local model folder" in capsys.readouterr().out
    assert main(["eval", "--model", str(model_dir), "--backends", "nope"]) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().out
