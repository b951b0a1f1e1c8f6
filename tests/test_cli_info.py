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


def test_the_settings_asked_for(capsys, monkeypatch):
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    monkeypatch.setenv("MOEKIT_PDL", "0")
    code, out = info(capsys)
    assert code == 0
    assert "FP8 accumulation fast" in out and "programmatic dependent launch off (MOEKIT_PDL)" in out


@pytest.mark.parametrize("name,value,expected", [("MOEKIT_PDL", "maybe", "expected 1"),
                                                 ("MOEKIT_FP8_ACCUMULATION", "sloppy", "expected one of precise, fast")])
def test_a_bad_setting_is_an_error_naming_it(name, value, expected, capsys, monkeypatch):
    monkeypatch.setenv(name, value)
    code, out = info(capsys)
    assert code == 2 and f"{name}='{value}'" in out and expected in out
