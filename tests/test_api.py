"""fused_moe's input checks, the backend override order and its errors."""

import logging
import os
import subprocess
import sys

import pytest
import torch

import moekit
from moekit.select import ENV_VAR

from helpers import REPO, random_routing, random_weights, random_x


@pytest.fixture
def problem():
    w = random_weights(4, 128, 128, "fp8-channel-token")
    tw, ids = random_routing(3, 4, 2)
    return random_x(3, 128), w, tw, ids


def test_override_order(problem, monkeypatch):
    x, w, tw, ids = problem
    shape, scheme = w.shape(2), w.scheme
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert moekit.select_backend(shape, scheme, "cpu").source == "heuristic"
    monkeypatch.setenv(ENV_VAR, "reference")
    choice = moekit.select_backend(shape, scheme, "cpu")
    assert (choice.backend, choice.source) == ("reference", "environment")
    # the argument beats the environment (torch: a backend that runs on the CPU on any machine)
    choice = moekit.select_backend(shape, scheme, "cpu", backend="torch")
    assert (choice.backend, choice.source) == ("torch", "argument")
    monkeypatch.setenv(ENV_VAR, "auto")
    assert moekit.select_backend(shape, scheme, "cpu").source == "heuristic"


def test_auto_on_cpu_never_picks_a_refusing_backend(problem, monkeypatch):
    x, w, tw, ids = problem
    monkeypatch.delenv(ENV_VAR, raising=False)
    choice = moekit.select_backend(w.shape(2), w.scheme, "cpu")
    assert choice.backend not in choice.refused
    assert not moekit.get_backend(choice.backend).supports(w.shape(2), w.scheme, torch.device("cpu"))


def test_forced_backend_that_cannot_run_lists_reasons_and_alternatives(problem, monkeypatch):
    x, w, tw, ids = problem
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    moekit.select._supports_cache.clear()
    with pytest.raises(moekit.BackendUnavailableError) as err:
        moekit.fused_moe(x, w, tw, ids, backend="triton")
    text = str(err.value)
    assert "TRITON_INTERPRET" in text and "reference" in text and "backends that can" in text
    monkeypatch.setenv(ENV_VAR, "triton")
    with pytest.raises(moekit.BackendUnavailableError, match=f"{ENV_VAR}=triton"):
        moekit.fused_moe(x, w, tw, ids)


def test_unknown_backend_lists_valid_names(problem):
    x, w, tw, ids = problem
    with pytest.raises(ValueError, match="unknown backend 'fast'.*reference"):
        moekit.fused_moe(x, w, tw, ids, backend="fast")


def test_get_backend_auto_says_auto_is_a_rule():
    """get_backend("auto") said "unknown backend 'auto'; expected one of: auto, ..."."""
    with pytest.raises(ValueError, match=r"auto is not a backend but the rule that chooses one per call.*select_backend"):
        moekit.get_backend("auto")


def test_interpreter_switched_on_after_import_is_refused_by_name():
    """TRITON_INTERPRET=1 set after `import moekit`: supports() said yes, then Triton failed with
    "0 active drivers": Triton had defined the kernels for the GPU at import."""
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    script = ("import os, moekit\nos.environ['TRITON_INTERPRET'] = '1'\n"
              "try:\n    moekit.env.interpreting()\nexcept RuntimeError as e:\n    print('REFUSED', e)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED TRITON_INTERPRET was set after moekit was imported" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "before importing moekit" in done.stdout


def test_interpreter_switched_on_after_import_refuses_what_launches_triton_kernels(problem, monkeypatch):
    """TRITON_INTERPRET=1 set after `import moekit` broke every backend, not only triton: the
    triton backend's supports() asked env.interpreting(), which raised inside select's refusals()
    for torch, reference and auto alike. Now it is triton's refusal reason, and on a GPU that of
    cutlass and torch too (their glue is Triton there; on the CPU it is torch ops). Simulated in process:
    the record of how the kernels were defined says "for the GPU" (restored after, as is select's
    cache, whose refusals are keyed by TRITON_INTERPRET's value)."""
    from moekit import env

    x, w, tw, ids = problem
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(moekit.select, "_supports_cache", {})
    monkeypatch.setattr(env, "_KERNELS_INTERPRETED", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    want = moekit.fused_moe(x, w, tw, ids, backend="reference")
    for backend in ("torch", "auto", None):
        out = moekit.fused_moe(x, w, tw, ids, backend=backend)
        assert out.shape == want.shape and (out.float() - want.float()).norm() <= 0.05 * want.float().norm()
    assert moekit.select_backend(w.shape(2), w.scheme, "cpu").backend != "triton"
    reasons = moekit.select.refusals(w.shape(2), w.scheme, "cpu", torch.bfloat16)["triton"]
    assert reasons[0].startswith("TRITON_INTERPRET was set after moekit was imported")
    assert not any("only under TRITON_INTERPRET=1" in r for r in reasons)  # it is set: not the reason
    with pytest.raises(moekit.BackendUnavailableError, match=r"(?s)'triton'.*set after moekit was imported.*"
                                                             r"before importing moekit.*backends that can: .*torch"):
        moekit.fused_moe(x, w, tw, ids, backend="triton")
    with pytest.raises(RuntimeError, match="set after moekit was imported"):  # what a launch step would say
        moekit.env.interpreting()
    # on a GPU the cutlass and torch backends launch the glue's Triton kernels: refused too there
    gpu = moekit.select.refusals(w.shape(2), w.scheme, moekit.select.DeviceSpec.from_name("NVIDIA H100 80GB HBM3"),
                                 torch.bfloat16)
    for name in ("cutlass", "torch"):
        assert any(r.startswith("its glue's Triton kernels cannot run: TRITON_INTERPRET was set after") for r in gpu[name])
    assert gpu["reference"] == []


def test_choice_is_logged_at_debug(problem, caplog):
    x, w, tw, ids = problem
    with caplog.at_level(logging.DEBUG, logger="moekit.select"):
        moekit.fused_moe(x, w, tw, ids, backend="reference")
    assert "reference (argument" in caplog.text


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda x, tw, ids: (x.float().double(), tw, ids), "x has dtype torch.float64"),
        (lambda x, tw, ids: (x[:, :100], tw, ids), "hidden size 100 but the weights expect 128"),
        (lambda x, tw, ids: (x[:2], tw, ids), "routing has 3 rows but x has 2"),
        (lambda x, tw, ids: (x, tw[:, :1], ids), "differ in shape"),
        (lambda x, tw, ids: (x, tw, ids + 10), r"topk_ids must lie in \[0, 4\)"),
        (lambda x, tw, ids: (x, tw, ids - 5), r"topk_ids must lie in \[0, 4\)"),
        (lambda x, tw, ids: (x, tw, ids.float()), "topk_ids has dtype torch.float32"),
        (lambda x, tw, ids: (x, tw.int(), ids), "topk_weights has dtype torch.int32"),
        (lambda x, tw, ids: (x[0], tw, ids), "x must be 2-D"),
        (lambda x, tw, ids: (x, torch.rand(3, 5), torch.zeros(3, 5, dtype=torch.int32)), "top-k must be between 1 and the number of experts"),
    ],
)
def test_bad_inputs(problem, mutate, match):
    x, w, tw, ids = problem
    x, tw, ids = mutate(x, tw, ids)
    with pytest.raises((ValueError, TypeError), match=match):
        moekit.fused_moe(x, w, tw, ids, backend="reference")


def test_validate_inputs_checks_against_the_models_expert_count():
    """num_experts= (expert parallel: the weights hold one rank's shard of the experts): top-k and
    the ids are checked against the model's expert count, not the shard's."""
    from moekit import api

    shard = random_weights(2, 128, 128, "fp8-channel-token")
    tw, ids = random_routing(3, 8, 2, experts=[5, 6, 7])
    x = random_x(3, 128)
    got_tw, got_ids = api.validate_inputs(x, shard, tw, ids.long(), num_experts=8)
    assert got_ids.dtype == torch.int32 and torch.equal(got_ids, ids)
    assert got_tw.dtype == torch.float32 and torch.equal(got_tw, tw)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 2\)"):
        api.validate_inputs(x, shard, tw, ids)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 6\)"):
        api.validate_inputs(x, shard, tw, ids, num_experts=6)
    with pytest.raises(ValueError, match=r"top-k must be between 1 and the number of experts \(1\), got 2"):
        api.validate_inputs(x, shard, tw, ids, num_experts=1)


def test_weights_validation():
    w = random_weights(2, 128, 128, "fp8-channel-token")
    with pytest.raises(ValueError, match="w13_scale is required"):
        moekit.MoEWeights.from_fp8("fp8-channel-token", w.w13, w.w2, None, w.w2_scale)
    with pytest.raises(ValueError, match=r"w2_scale has shape \(2, 5\); expected \(2, 128\)"):
        moekit.MoEWeights.from_fp8("fp8-channel-token", w.w13, w.w2, w.w13_scale, torch.ones(2, 5))
    with pytest.raises(ValueError, match="w13 has dtype torch.bfloat16; expected torch.float8_e4m3fn"):
        moekit.MoEWeights.from_fp8("fp8-channel-token", w.w13.bfloat16(), w.w2, w.w13_scale, w.w2_scale)
    with pytest.raises(ValueError, match="unknown quantization scheme 'int4'"):
        moekit.quantize_weights(torch.randn(2, 8, 8), torch.randn(2, 8, 4), "int4")
    with pytest.raises(ValueError, match="multiple of 128"):
        moekit.quantize_weights(torch.randn(2, 192, 128), torch.randn(2, 128, 96), "fp8-block128")
    with pytest.raises(ValueError, match="input_scales=.*calibration="):
        moekit.quantize_weights(torch.randn(2, 8, 16), torch.randn(2, 16, 4), "fp8-tensor-static")
    with pytest.raises(ValueError, match="is unquantized but scales were given"):
        moekit.MoEWeights("bf16", torch.randn(2, 8, 16).bfloat16(), torch.randn(2, 16, 4).bfloat16(), torch.ones(2))


def test_static_scales_from_checkpoint_and_calibration():
    w13, w2 = torch.randn(2, 8, 16), torch.randn(2, 16, 4)
    w = moekit.quantize_weights(w13, w2, "fp8-tensor-static", input_scales=(0.5, 0.25))
    assert w.a13_scale.item() == 0.5 and w.a2_scale.item() == 0.25
    x = torch.randn(10, 16)
    w = moekit.quantize_weights(w13, w2, "fp8-tensor-static", calibration=x)
    assert w.a13_scale.item() == pytest.approx(x.abs().max().item() / 448)
    assert w.a2_scale.item() > 0


def test_nbytes_is_the_fp8_size():
    w = random_weights(4, 128, 128, "fp8-channel-token")
    assert w.nbytes == 4 * 3 * 128 * 128 + 4 * (2 * 128 + 128) * 4


# ---------------------------------------------------------------- MOEKIT_BACKEND's spelling


@pytest.mark.parametrize("value", ["", "  ", "auto", " auto\n"])
def test_empty_or_auto_environment_backend_is_auto(problem, monkeypatch, value):
    """MOEKIT_BACKEND is stripped like MOEKIT_PDL and MOEKIT_FP8_ACCUMULATION; empty means unset
    (before, "" raised "unknown backend ''")."""
    x, w, tw, ids = problem
    monkeypatch.setenv(ENV_VAR, value)
    assert moekit.select_backend(w.shape(2), w.scheme, "cpu").source == "heuristic"
    assert moekit.fused_moe(x, w, tw, ids).shape == x.shape


def test_environment_backend_is_stripped(problem, monkeypatch):
    w = problem[1]
    monkeypatch.setenv(ENV_VAR, " reference\n")
    choice = moekit.select_backend(w.shape(2), w.scheme, "cpu")
    assert (choice.backend, choice.source) == ("reference", "environment")


@pytest.mark.parametrize("value", ["Triton", "fast"])
def test_unknown_environment_backend_names_the_variable(problem, monkeypatch, value):
    x, w, tw, ids = problem
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(ValueError, match=f"^{ENV_VAR}='{value}': unknown backend '{value}'; expected one of: auto, "):
        moekit.fused_moe(x, w, tw, ids)


# ------------------------------------------------------------- MOEKIT_FP8_ACCUMULATION, any backend


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
def test_bad_fp8_accumulation_is_refused_whatever_the_backend(problem, monkeypatch, backend):
    """README: any value but precise / fast is refused with an error. Before, only the triton
    backend refused it; under auto the decision tables warned and another backend ran."""
    x, w, tw, ids = problem
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "bogus")
    with pytest.raises(ValueError, match=r"MOEKIT_FP8_ACCUMULATION='bogus': expected one of precise, fast"):
        moekit.fused_moe(x, w, tw, ids, backend)
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", " Fast ")  # stripped, any case: valid
    assert moekit.fused_moe(x, w, tw, ids, backend).shape == x.shape


# ------------------------------------------------------------------ int64 ids on the device path


def test_int64_ids_stay_out_of_range_when_narrowed(monkeypatch):
    """On a GPU the ids are checked on the device, on the int32 ids the backends receive: an
    int64 id 2**32 + 3 narrowed to 3 and ran expert 3. Now int64 ids are narrowed by
    glue.narrow_ids, which writes an id out of range as -1 (one launch, as the cast). The device path is taken here on CPU tensors (the checking kernel runs in
    the interpreter, where torch._assert_async raises at once)."""
    from moekit.backends.glue import ops

    if not ops.interpreting():
        pytest.skip("the device-side check runs on CPU tensors only under TRITON_INTERPRET=1")
    from moekit import api

    monkeypatch.setattr(api, "_ids_checked_on_device", lambda ids: True)
    w = random_weights(4, 128, 128, "fp8-channel-token")
    tw, ids = random_routing(3, 4, 2)
    x = random_x(3, 128)
    bad = ids.long()
    bad[1, 0] = 2**32 + 3  # int32: 3, in range
    with pytest.raises(RuntimeError, match=r"topk_ids outside \[0, 4\)"):  # fused_moe's own check
        moekit.fused_moe(x, w, tw, bad, "reference")  # (the glue's backends check in their kernel: test_glue_id_check)
    _, narrowed = api.validate_inputs(x, w, tw, bad, device_check=False)  # the backend checks these
    assert narrowed.dtype == torch.int32 and int(narrowed[1, 0]) == -1  # out of range, not expert 3
    assert torch.equal(narrowed.long()[bad < 4], bad[bad < 4])  # the others unchanged
    bad[2, 1] = -(2**32) + 1  # int32: 1
    assert int(api.validate_inputs(x, w, tw, bad, device_check=False)[1][2, 1]) == -1
    with pytest.raises(RuntimeError, match=r"topk_ids outside \[0, 4\)"):
        api.validate_inputs(x, w, tw, bad)
    assert moekit.fused_moe(x, w, tw, ids.long(), "reference").shape == x.shape  # in range: runs


def test_narrow_ids_keeps_every_id_in_range_and_marks_the_rest():
    """glue.narrow_ids over several programs: ids in [0, E) unchanged, every other (negative,
    E itself, beyond int32) -1; an empty input gives an empty int32 tensor."""
    from moekit.backends.glue import ops

    if not ops.interpreting():
        pytest.skip("a Triton kernel: CUDA or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(5)
    E = 7
    ids = torch.randint(-3, E + 3, (2 * ops.NARROW_IDS_BLOCK + 5,), generator=g, dtype=torch.int64)
    ids[::97] += 2**32  # wraps into [0, E) under a plain cast
    out = ops.narrow_ids(ids.view(-1, 5) if ids.numel() % 5 == 0 else ids, E)
    want = torch.where((ids >= 0) & (ids < E), ids, -1).to(torch.int32)
    assert out.dtype == torch.int32 and torch.equal(out.reshape(-1), want)
    assert ops.narrow_ids(torch.empty(0, 2, dtype=torch.int64), E).shape == (0, 2)


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), ("", False), ("off", False),
                                            ("true", True), ("TRUE", True), ("on", True)])
def test_one_reading_of_triton_interpret(monkeypatch, value, expected, interpret_switchable):
    """The glue read TRITON_INTERPRET as anything but "" / "0", the triton backend's launch steps
    as exactly "1": with "yes" the glue launched interpreted kernels that the backend's supports()
    said could not run. Then "true", which Triton reads as on, made moekit launch interpreted
    kernels with its interpreter fixes off (wrong output). Every module now follows
    moekit.env.interpreting, which is Triton's own reading."""
    from triton import knobs

    from moekit import env
    from moekit.backends.glue import ops
    from moekit.backends.triton import launch

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert bool(knobs.runtime.interpret) is expected  # Triton's reading, which moekit must share
    assert env.interpreting() is expected
    assert ops.interpreting() is expected
    assert launch._interpreting() is expected


def test_a_layer_runs_on_its_tensors_gpu_whichever_gpu_is_current(monkeypatch):
    """Triton launches on the current GPU whatever device the tensors are on, so fused_moe makes
    x's GPU current for the call where another one is (a model spread over GPUs). Checked without
    a GPU: on_device's choice, and that fused_moe runs inside it."""
    from moekit import api

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    guard = api.on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    for same in (torch.device("cuda", 0), torch.device("cuda"), torch.device("cpu")):
        assert not isinstance(api.on_device(same), torch.cuda.device), same
    entered = []
    real = api.on_device
    monkeypatch.setattr(api, "on_device", lambda device: entered.append(device) or real(device))
    w = random_weights(3, 64, 32, "bf16")
    tw, ids = random_routing(4, 3, 2)
    x = random_x(4, 64)
    assert moekit.fused_moe(x, w, tw, ids, "reference").shape == x.shape
    assert entered == [x.device]


@pytest.mark.gpu
def test_gpu_narrow_ids_in_a_cuda_graph():
    """On the GPU, int64 ids are narrowed by glue.narrow_ids (fused_moe does it for the backends
    that do not read them as they are: reference; validate_inputs for its callers):
    in range unchanged, out of range -1, also replayed in a CUDA graph with new ids."""
    from moekit.backends.glue import ops

    E = 7
    ids = torch.randint(-3, E + 3, (64, 8), device="cuda", dtype=torch.int64)
    ids[::5, 0] += 2**32
    want = lambda t: torch.where((t >= 0) & (t < E), t, -1).to(torch.int32)  # noqa: E731
    assert torch.equal(ops.narrow_ids(ids, E), want(ids))
    static = ids.clone()
    ops.narrow_ids(static, E)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.narrow_ids(static, E)
    static.copy_(torch.randint(-3, E + 3, static.shape, device="cuda", dtype=torch.int64))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want(static))


@pytest.mark.parametrize("flag", ["apply_router_weight_on_input", "allow_weight_copies"])
@pytest.mark.parametrize("bad", ["no", "False", None, 0, 1])
def test_flags_must_be_true_or_false(flag, bad):
    """apply_router_weight_on_input="no" gave exactly the output of True (a non-empty string is
    truthy), and None quietly meant False; RoutingConfig refuses such values, and so does
    fused_moe now, with the same check (routing.check_flag)."""
    w = random_weights(4, 128, 128, "bf16")
    tw, ids = random_routing(3, 4, 1)
    with pytest.raises(ValueError, match=rf"^{flag} must be True or False, got {bad!r}$"):
        moekit.fused_moe(random_x(3, 128), w, tw, ids, "reference", **{flag: bad})


def test_numpy_bools_are_bools():
    """A NumPy bool can only be True or False (RoutingConfig takes it too): it runs as that bool."""
    np = pytest.importorskip("numpy")
    w = random_weights(4, 128, 128, "bf16")
    tw, ids = random_routing(3, 4, 1)
    x = random_x(3, 128)
    for value in (True, False):
        want = moekit.fused_moe(x, w, tw, ids, "reference", apply_router_weight_on_input=value)
        got = moekit.fused_moe(x, w, tw, ids, "reference", apply_router_weight_on_input=np.bool_(value),
                               allow_weight_copies=np.True_)
        assert torch.equal(got, want)


def test_an_x_that_is_not_a_tensor_is_a_type_error_naming_x(problem):
    """x=None or a NumPy x raised an AttributeError from on_device(x.device), before any check;
    the other inputs already got this TypeError."""
    np = pytest.importorskip("numpy")
    x, w, tw, ids = problem
    for bad in (None, x.float().numpy(), x.tolist()):
        with pytest.raises(TypeError, match=rf"^x must be a torch.Tensor, got {type(bad).__name__}$"):
            moekit.fused_moe(bad, w, tw, ids)
    with pytest.raises(TypeError, match=r"^topk_weights must be a torch.Tensor, got ndarray$"):
        moekit.fused_moe(x, w, np.asarray(tw), ids)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_select_backend_refuses_what_fused_moe_refuses(problem, dtype):
    """select_backend answered `reference` for float64 (and int8) activations, and moekit.warmup
    reported sizes warmed on it, while fused_moe refuses such an x: all three refuse it now, in
    the same words."""
    x, w, tw, ids = problem
    with pytest.raises(ValueError) as run:
        moekit.fused_moe(torch.zeros(x.shape, dtype=dtype), w, tw, ids)
    expected = str(run.value).split(";", 1)[1]  # what fused_moe says it expects
    assert str(run.value) == f"x has dtype {dtype};{expected}"
    for call in (lambda: moekit.select_backend(w.shape(2), w.scheme, "cpu", dtype, 3),
                 lambda: moekit.select.refusals(w.shape(2), w.scheme, "cpu", dtype),
                 lambda: moekit.warmup(w, 2, 2, dtype=dtype)):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == f"dtype is {dtype};{expected}"
    # what fused_moe runs, select_backend answers
    for dtype in moekit.dtypes.FUSED_MOE_DTYPES:
        assert moekit.select_backend(w.shape(2), w.scheme, "cpu", dtype, 3).backend
