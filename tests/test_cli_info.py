"""`moekit info`: device, versions, the triton backend's settings from the environment, and which
backends can run here."""

import argparse

import pytest
import torch

from moekit.cli import main


def info(capsys) -> tuple[int, str]:
    code = main(["info"])
    return code, " ".join(capsys.readouterr().out.split())  # rich wraps long lines


def test_defaults_on_this_machine(capsys, monkeypatch):
    monkeypatch.delenv("MOEKIT_FP8_ACCUMULATION", raising=False)
    monkeypatch.delenv("MOEKIT_PDL", raising=False)
    code, out = info(capsys)
    assert code == 0
    assert "FP8 accumulation precise (MOEKIT_FP8_ACCUMULATION)" in out
    if not torch.cuda.is_available():  # CI: the launch option cannot be used, whatever is asked
        assert "programmatic dependent launch unavailable here" in out
    assert "reference" in out and "triton" in out  # the backend table
    routing = "one Triton kernel" if torch.cuda.is_available() else "torch ops (the routing kernel runs on a GPU)"
    assert f"moekit.route here: {routing}" in out


def test_the_settings_asked_for(capsys, monkeypatch):
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    monkeypatch.setenv("MOEKIT_PDL", "0")
    monkeypatch.setenv("MOEKIT_BACKEND", "torch")
    code, out = info(capsys)
    assert code == 0
    assert "FP8 accumulation fast" in out and "programmatic dependent launch off (MOEKIT_PDL)" in out
    assert "backend of calls that leave it to auto: torch (MOEKIT_BACKEND)" in out
    monkeypatch.delenv("MOEKIT_BACKEND")
    assert "backend of calls that leave it to auto: chosen per call (MOEKIT_BACKEND unset)" in info(capsys)[1]


@pytest.mark.parametrize("name,value,expected", [("MOEKIT_PDL", "maybe", "expected 1"),
                                                 ("MOEKIT_FP8_ACCUMULATION", "sloppy", "expected one of precise, fast"),
                                                 ("MOEKIT_BACKEND", "nonsense", "unknown backend 'nonsense'")])
def test_a_bad_setting_is_an_error_naming_it(name, value, expected, capsys, monkeypatch):
    monkeypatch.setenv(name, value)
    code, out = info(capsys)
    assert code == 2 and f"{name}='{value}'" in out and expected in out


# -------------------------------------------------------------------------- the flags


def parse(*argv):
    from moekit.cli import build_parser

    if argv[0] == "select" and "--batch-size" not in argv:  # required there; these tests are about others
        argv = (*argv, "--batch-size", "1")
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", ["bench", "check", "tune", "select", "warmup"])
@pytest.mark.parametrize("flag", ["--tp", "--tp-size", "-tp", "--tensor-parallel-size"])
def test_vllm_spellings_of_tp_are_aliases(command, flag):
    model = ["--model", "mixtral-8x7b"]
    assert int(parse(command, *model, flag, "4").tp) == 4


@pytest.mark.parametrize("command", ["bench", "check", "tune", "warmup"])
def test_batch_size_is_an_alias_of_batch_sizes(command):
    args = parse(command, "--model", "mixtral-8x7b", "--batch-size", "8", "64")
    assert args.batch_sizes == ["8", "64"]


@pytest.mark.parametrize("argv", [
    ["bench", "--model", "mixtral-8x7b", "--batch", "8"],  # a prefix of --batch-size(s)
    ["bench", "--model", "mixtral-8x7b", "--refresh"],
    ["tune", "--model", "mixtral-8x7b", "--search", "full"],
    ["select", "--model", "mixtral-8x7b", "--device", "H100"],
    ["eval", "--model", "x", "--max", "10"],
])
def test_abbreviated_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_tune_scheme_help_names_the_comma_separated_list():
    from moekit.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["tune"]
    (scheme,) = [a for a in sub._actions if a.dest == "scheme"]
    assert "comma-separated" in scheme.help


def test_bench_measures_its_ceilings_in_the_same_run_unless_told():
    """Issue 3's method: the floor from ceilings measured in the same run. bench reused an earlier
    run's cached ceilings unless --refresh-ceilings; now it measures them unless --cached-ceilings
    (--refresh-ceilings still parses, as the default)."""
    from moekit.bench import BenchOptions

    model = ["--model", "mixtral-8x7b"]
    assert parse("bench", *model).refresh_ceilings is True
    assert parse("bench", *model, "--refresh-ceilings").refresh_ceilings is True
    assert parse("bench", *model, "--cached-ceilings").refresh_ceilings is False
    assert BenchOptions(models=["mixtral-8x7b"]).refresh_ceilings is True


def test_models_and_info_are_readable_in_a_pipe(capsys):
    """Into a pipe rich assumed 80 columns and cut the names ('glm-4…'), unlike bench and check."""
    from moekit.models import PRESETS

    from moekit.backends import backend_names

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS) and "…" not in out
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in backend_names()) and "…" not in out


@pytest.mark.parametrize("command", ["bench", "check", "tune", "warmup", "select"])
@pytest.mark.parametrize("spelling,expected", [("bf16", "bf16"), ("bfloat16", "bf16"), ("BF16", "bf16"),
                                               ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16")])
def test_dtype_takes_torch_and_vllm_spellings(command, spelling, expected):
    assert parse(command, "--model", "mixtral-8x7b", "--dtype", spelling).dtype == expected


@pytest.mark.parametrize("value,hint", [("fp8_w8a8", True), ("int8_w8a16", True), ("float32", False)])
def test_a_quantization_given_as_dtype_points_to_scheme(value, hint, capsys):
    """vLLM's tuning scripts take the quantization as --dtype (fp8_w8a8); moekit's --dtype is the
    activations', and the quantization its --scheme: the error says so, with this command's usage."""
    with pytest.raises(SystemExit) as e:
        main(["tune", "--model", "mixtral-8x7b", "--dtype", value])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and f"'{value}' is not an activation dtype: expected bf16 or fp16" in err
    assert ("the quantization is --scheme here" in err) == hint
    assert "usage: moekit tune" in err


def test_an_unknown_flag_shows_the_commands_usage_not_the_top_level_one(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--model", "mixtral-8x7b", "--batchsize", "8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: moekit bench" in err and "unrecognized arguments: --batchsize 8" in err


@pytest.mark.parametrize("command", ["bench", "check", "tune", "select", "warmup", "eval"])
def test_a_mistyped_flag_is_named_before_a_missing_required_one(command, capsys):
    """argparse checks the required flags first: `bench --mdoel X` said "--model is required" and
    never named --mdoel."""
    with pytest.raises(SystemExit) as e:
        main([command, "--mdoel", "olmoe-1b-7b", "--batch-sizes", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"usage: moekit {command}" in err, err
    assert "unrecognized arguments: --mdoel olmoe-1b-7b" in err and "required" not in err, err
    with pytest.raises(SystemExit):  # nothing unrecognized: the missing flag is reported as before
        main([command])
    assert "the following arguments are required: --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a word alone, --model forgotten: the missing flag says it best
        main([command, "olmoe-1b-7b"])
    err = capsys.readouterr().err
    assert "the following arguments are required: --model" in err and "unrecognized" not in err, err


def test_select_usage_shows_its_required_flags_as_required(capsys):
    """select's usage line showed [--model] and [--batch-size], as if optional."""
    with pytest.raises(SystemExit) as e:
        main(["select", "--help"])
    usage = " ".join(capsys.readouterr().out.split("options:")[0].split())
    assert e.value.code == 0 and "--model NAME|PATH" in usage and "--batch-size M" in usage, usage
    assert "[--model" not in usage and "[--batch-size" not in usage, usage
    with pytest.raises(SystemExit) as e:
        main(["select", "--model", "mixtral-8x7b"])
    assert e.value.code == 2 and "the following arguments are required: --batch-size" in capsys.readouterr().err


def test_version_and_python_dash_m(capsys):
    import subprocess
    import sys

    import moekit

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"moekit {moekit.__version__}"
    done = subprocess.run([sys.executable, "-m", "moekit", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"moekit {moekit.__version__}", done.stderr


@pytest.mark.parametrize("argv,expected", [
    (["--batch-size", "65537"], "--batch-size: 65537 is above 65536, the largest batch size moekit takes"),
    (["--batch-size", "0"], "--batch-size must be a positive integer, got '0'"),
])
def test_select_refuses_a_missing_or_out_of_range_batch_size(argv, expected, capsys):
    assert main(["select", "--model", "mixtral-8x7b", *argv]) == 2
    assert expected in " ".join(capsys.readouterr().out.split())


def test_info_says_per_scheme_which_backends_can_run_and_why_not(capsys):
    """One table row per backend and one column per scheme (it answered for fp8-channel-token
    alone, so cutlass looked available for block FP8, which it refuses), then the reasons."""
    from moekit.backends import backend_names, get_backend
    from moekit.spec import SCHEMES, MoEShape

    code, out = info(capsys)
    assert code == 0
    for name in ("bf16", "fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token", "fp8-block128"):
        assert name in out
    shape, device = MoEShape(8, 4096, 1024, 2), torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for backend in backend_names():
        refused = {s: get_backend(backend).supports(shape, SCHEMES[s], device) for s in SCHEMES if s != "fp16"}
        for scheme, reasons in refused.items():
            for reason in reasons:  # every reason is printed, once per backend or per scheme
                assert " ".join(reason.split()) in out, (backend, scheme, reason)
    assert "reference" in out and "yes" in out


def test_every_flag_with_a_default_says_it_in_its_help():
    """A flag whose value is not given runs with its default: --help says which (the review found
    --reps, --warmup, --seeds ... silent)."""
    from moekit.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    silent = [(name, a.option_strings[0]) for name, parser in sub.choices.items() for a in parser._actions
              if a.default not in (None, False, argparse.SUPPRESS) and not isinstance(a.default, bool)
              and a.help not in (None, argparse.SUPPRESS) and "default" not in a.help]
    assert silent == []


def test_bench_with_a_moekit_backend_that_cannot_run_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """bench printed the BackendUnavailableError as a bullet list over four lines; its errors are
    one line. olmoe-1b-7b is bf16, which cutlass refuses on any machine."""
    monkeypatch.setenv("MOEKIT_BACKEND", "cutlass")
    out = tmp_path / "o"
    assert main(["bench", "--model", "olmoe-1b-7b", "--batch-sizes", "1", "--out", str(out)]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: auto's rows of olmoe-1b-7b at M = 1: backend 'cutlass' "
                                                    "(from MOEKIT_BACKEND=cutlass) cannot run this problem: "), lines
    assert "scheme bf16 is unquantized" in lines[0] and "backends that can: " in lines[0]
    assert not out.exists()
