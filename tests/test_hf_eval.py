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
def checkpoints(tmp_path_factory):
    """(FP8 checkpoint folder, the bf16 one it was quantized from), each with a tokenizer."""
    fp8, bf16 = fp8_checkpoint(tmp_path_factory, "mixtral")
    tokenizer = tiny_tokenizer(DEFAULT_TEXT.read_text())
    for folder in (fp8, bf16):
        tokenizer.save_pretrained(folder)
    return fp8, bf16


@pytest.fixture
def model_dir(checkpoints):
    return checkpoints[0]


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
    # bench.json's and check.json's metadata: what ran, where and when (it had none of it)
    assert {"device", "torch", "moekit", "git_commit", "date", "command"} <= set(report["metadata"])
    assert report["metadata"]["command"].startswith("moekit eval --model ")


def test_eval_fused_routing_rows(model_dir, tmp_path, monkeypatch):
    """--fused-routing adds a row per backend with the routers fused (reference's too); the
    unfused reference row stays every row's baseline. On the CPU the fused routers (top-2: one rounding in any order) give
    transformers' routing bitwise, so a fused row's scores are its backend's exactly: KL 0 and
    top-1 agreement 1 between the two rows. The model's routers are transformers' again after."""
    from moekit.hf import routers

    routed = []  # the token counts route() saw outside the check (whose calls take CHECK_TOKENS)

    def spy(logits, **kwargs):
        if logits.shape[0] != routers.CHECK_TOKENS:
            routed.append(logits.shape[0])
        return route(logits, **kwargs)

    route = routers.route
    monkeypatch.setattr(routers, "route", spy)
    out = tmp_path / "report.json"
    rc = main(["eval", "--model", str(model_dir), "--backends", "torch", "--max-tokens", "60",
               "--seq-len", "30", "--gen-tokens", "3", "--fused-routing", "--out", str(out)])
    assert rc == 0
    assert routed, "the fused rows never ran the fused routers"  # compressed-tensors wraps every forward
    report = json.loads(out.read_text())
    assert report["fused_routing"] is True
    assert list(report["backends"]) == ["reference", "torch", "reference+fused-routing", "torch+fused-routing"]
    assert report["pairwise"]["reference|reference+fused-routing"]["kl_mean"] == 0
    fused = report["backends"]["torch+fused-routing"]
    assert fused["backend"] == "torch" and fused["fused_routing"] is True
    assert report["backends"]["torch"]["fused_routing"] is False
    pair = report["pairwise"]["torch|torch+fused-routing"]
    assert pair["kl_mean"] == 0 and pair["top1_agreement"] == 1
    assert fused["generated"] == report["backends"]["torch"]["generated"]


def test_eval_bad_input(model_dir, tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "nowhere")]) == 2
    assert "not a local model folder" in capsys.readouterr().out
    assert main(["eval", "--model", str(model_dir), "--backends", "nope"]) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().out


@pytest.fixture
def no_load(monkeypatch):
    """Loading the model fails the test: what is checked here must be refused before it."""
    import moekit.hf

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(moekit.hf, "from_pretrained", load)


def one_line_error(capsys) -> str:
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    return lines[0]


def test_eval_options_are_refused_before_the_model_loads(checkpoints, tmp_path, no_load, capsys):
    fp8, bf16 = checkpoints
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    cases = [
        ([fp8, "--backends", "torch", "tirton"], "--backends: unknown backend 'tirton'"),
        ([fp8, "--scheme", "bogus"], "--scheme: unknown quantization scheme 'bogus'; expected one of: bf16"),
        # an FP8 checkpoint is loaded as stored: the command line's words, not from_pretrained's scheme=None
        ([fp8, "--scheme", "fp8-block128"],
         "are fp8-channel-token, and FP8 experts are loaded as stored; leave out --scheme"),
        # static scales need calibration text, which no flag gives: say so, and what to do instead
        ([bf16, "--scheme", "fp8-tensor-static"], "which moekit eval does not take; use --scheme fp8-tensor-dynamic"),
        ([fp8, "--out", str(tmp_path)], f"--out {tmp_path}: is a folder"),
        ([fp8, "--out", str(a_file / "report.json")], f"{a_file} is a file, not a folder"),
        # an existing file (a report, or anything else) is replaced only when asked
        ([fp8, "--out", str(a_file)], "the file exists; pass --overwrite to replace it"),
        ([fp8, "--text", str(tmp_path)], "is not a file"),
    ]
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    cases.append(([fp8, "--text", str(binary)], "not UTF-8 text"))
    for args, expected in cases:
        assert main(["eval", "--model", str(args[0]), *args[1:]]) == 2, args
        line = " ".join(one_line_error(capsys).split())
        assert expected in line, line
    assert a_file.read_text() == "x"


@pytest.mark.parametrize("name,value,expected", [
    ("MOEKIT_FP8_ACCUMULATION", "bad", "expected one of precise, fast"),
    ("MOEKIT_PDL", "maybe", "expected 1 (on, the default where the GPU has it) or 0 (off)"),
    ("MOEKIT_BACKEND", "nonsense", "unknown backend 'nonsense'; expected one of: auto, "),
])
def test_eval_refuses_a_bad_environment_before_the_model_loads(name, value, expected, model_dir, tmp_path,
                                                                  no_load, monkeypatch, capsys):
    """bench, check and tune refuse these up front (test_bench_cli); eval loaded the whole model
    first and then said "cannot load the model (ValueError: MOEKIT_FP8_ACCUMULATION='bad' ...)"."""
    monkeypatch.setenv(name, value)
    out = tmp_path / "reports" / "r.json"
    assert main(["eval", "--model", str(model_dir), "--out", str(out)]) == 2
    line = " ".join(one_line_error(capsys).split())
    assert f"{name}='{value}': {expected}" in line and "cannot load" not in line, line
    assert not (tmp_path / "reports").exists()

def test_eval_without_a_tokenizer_is_one_line_after_the_out_check(checkpoints, tmp_path, no_load, capsys):
    """transformers' error for a folder without a tokenizer runs over five lines, which eval
    printed as they were; and the tokenizer was loaded before --out was checked, so an existing
    --out file was not reported."""
    import shutil

    folder = tmp_path / "notok"
    folder.mkdir()
    for f in [checkpoints[0] / "config.json", *checkpoints[0].glob("*.safetensors")]:
        shutil.copy(f, folder)
    assert main(["eval", "--model", str(folder)]) == 2
    assert f"{folder}: no usable tokenizer in the model folder (" in one_line_error(capsys)
    existing = tmp_path / "report.json"
    existing.write_text("x")
    assert main(["eval", "--model", str(folder), "--out", str(existing)]) == 2
    assert "the file exists; pass --overwrite to replace it" in one_line_error(capsys)


def test_eval_of_a_folder_whose_tokenizer_is_empty_names_the_tokenizer(tmp_path, no_load, capsys):
    """Without tokenizer files, transformers 5.25 builds a Qwen3-MoE folder's tokenizer with an
    empty vocabulary (Mixtral's raises, above), which encodes any text into no ids: eval blamed the
    text ("eval.txt: fewer than 2 tokens to score"). It names the tokenizer, as from_pretrained's
    calibration text does (test_hf_errors), and how to save one."""
    from test_hf_tiny import tiny_model

    folder = tmp_path / "qwen3"
    tiny_model("qwen3_moe").save_pretrained(folder)
    assert main(["eval", "--model", str(folder)]) == 2
    line = " ".join(one_line_error(capsys).split())
    assert f"the tokenizer of {str(folder)!r} encoded the text into no token ids" in line, line
    assert "tokenizer.json" in line and "moekit.hf.save_pretrained does not write the tokenizer" in line, line
    assert "fewer than 2 tokens" not in line

def test_eval_of_a_folder_that_does_not_load_is_one_line_and_leaves_no_folder(checkpoints, tmp_path, capsys):
    """A folder without weights, or with a truncated safetensors file, ended in a traceback
    (OSError, SafetensorError), after --out's folder had been created."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoints[0], broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:64])
    out = tmp_path / "reports" / "r.json"
    assert main(["eval", "--model", str(broken), "--backends", "torch", "--out", str(out)]) == 2
    line = " ".join(one_line_error(capsys).split())
    assert f"--model {str(broken)!r}: cannot load the model" in line, line
    assert not (tmp_path / "reports").exists()


def test_eval_without_the_hf_extra_says_which_extra():
    """Without transformers, moekit eval ended in a ModuleNotFoundError traceback. In a process of
    its own, where transformers cannot be imported."""
    import subprocess
    import sys

    from helpers import REPO

    script = ("import sys; sys.modules['transformers'] = None\n"
              "from moekit.cli import main\nsys.exit(main(['eval', '--model', 'anywhere']))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr[-2000:]
    assert "moekit eval needs transformers: pip install 'moekit[hf]'" in " ".join(done.stdout.split())
    assert "Traceback" not in done.stdout + done.stderr



def test_eval_quantizes_a_bf16_checkpoint_on_load(checkpoints, tmp_path):
    out = tmp_path / "new" / "report.json"  # the folder is created
    assert main(["eval", "--model", str(checkpoints[1]), "--scheme", "fp8-channel-token", "--backends", "torch",
                 "--max-tokens", "20", "--seq-len", "20", "--gen-tokens", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["scheme"] == "fp8-channel-token" and list(report["backends"]) == ["reference", "torch"]
    assert [p.name for p in out.parent.iterdir()] == ["report.json"]  # no temporary left beside it


def test_default_backends_leave_out_the_interpreted_ones_on_the_cpu(model_dir):
    """bench's default rule: triton runs on the CPU only in the Triton interpreter (2 tokens/s on
    this tiny model), so a default eval there leaves it out; named, it runs (test above)."""
    import torch

    import moekit.hf as mh
    from moekit.backends import get_backend
    from moekit.hf.eval import _plan_backends

    model = mh.from_pretrained(str(model_dir), backend="reference")
    weights = next(iter(mh.experts_modules(model).values())).moe_weights()
    cpu = torch.device("cpu")
    planned = _plan_backends(None, weights, cpu, torch.bfloat16)
    runnable = [b for b in ("torch", "cutlass") if not get_backend(b).supports(weights.shape(1), weights.scheme, cpu,
                                                                               torch.bfloat16)]
    assert planned == ["reference", *runnable] and "triton" not in planned
    if get_backend("triton").supports(weights.shape(1), weights.scheme, cpu, torch.bfloat16):
        pytest.skip("named triton runs on the CPU only under TRITON_INTERPRET=1 (a GPU machine's run has it unset)")
    assert _plan_backends(["triton"], weights, cpu, torch.bfloat16) == ["reference", "triton"]
