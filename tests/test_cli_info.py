"""`moekit info`: device, versions, the triton backend's settings from the environment, and which
backends can run here."""

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
