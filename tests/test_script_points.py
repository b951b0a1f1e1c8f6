"""scripts/diag_points.py's parsers of "model:tp[:scheme]" and "model:tp:M[:scheme]", which every
bench and diag script under scripts/ reads its models or points with (those scripts need a GPU;
their parsing does not)."""

import os
import subprocess
import sys

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import diag_points  # noqa: E402

from moekit.models import get_model  # noqa: E402


def test_a_model_in_its_own_scheme_or_the_one_named():
    m = diag_points.parse_model("glm-4.5v-fp8:2")
    assert (m.name, m.tp) == ("glm-4.5v-fp8", 2)
    assert m.spec.shape == get_model("glm-4.5v-fp8", 2).shape and m.scheme.name == "fp8-channel-token"
    assert diag_points.parse_model("mixtral-8x7b:1:fp8-block128").scheme.name == "fp8-block128"
    assert diag_points.parse_model("mixtral-8x7b:1", "bf16").scheme.name == "bf16"  # the script's default
    assert diag_points.parse_model("mixtral-8x7b:1:fp8-tensor-dynamic", "bf16").scheme.name == "fp8-tensor-dynamic"


def test_a_point():
    (model, tp, spec, scheme), M = diag_points.parse_point("deepseek-v3:8:4096")
    assert (model, tp, M, scheme.name) == ("deepseek-v3", 8, 4096, "fp8-block128")
    assert spec.shape == get_model("deepseek-v3", 8).shape
    assert diag_points.parse_point("glm-4.5v-fp8:2:1:bf16")[0].scheme.name == "bf16"


@pytest.mark.parametrize("text,message", [
    ("glm-4.5v-fp8", r"expected model:tp\[:scheme\]"),
    ("glm-4.5v-fp8:2:fp8-block128:x", r"expected model:tp\[:scheme\]"),
    ("glm-4.5v-fp8::fp8-block128", r"expected model:tp\[:scheme\]"),
    ("glm-4.5v-fp8:two", r"tp must be a positive integer, got 'two'"),
    ("glm-4.5v-fp8:0", r"tp must be a positive integer, got '0'"),
    ("glm-4.5v-fp8:3", r"not divisible by tp \(3\)"),
    ("no-such-model:1", r"unknown model 'no-such-model'"),
    ("mixtral-8x7b:1:fp9", r"unknown quantization scheme 'fp9'"),
])
def test_a_bad_model_names_what_is_wrong(text, message):
    with pytest.raises(SystemExit, match=message):
        diag_points.parse_model(text)


def test_a_script_of_one_scheme_refuses_a_scheme_field():
    assert diag_points.parse_model("mixtral-8x7b:1", "fp8-channel-token", scheme_field=False).tp == 1
    with pytest.raises(SystemExit, match=r"expected model:tp, .*this script runs fp8-channel-token"):
        diag_points.parse_model("mixtral-8x7b:1:bf16", "fp8-channel-token", scheme_field=False)


@pytest.mark.parametrize("text,message", [
    ("glm-4.5v-fp8:2", r"expected model:tp:M\[:scheme\]"),
    ("glm-4.5v-fp8:2:0", r"M must be a positive integer, got '0'"),
    ("glm-4.5v-fp8:2:-4", r"M must be a positive integer, got '-4'"),
    ("glm-4.5v-fp8:2:4k", r"M must be a positive integer, got '4k'"),
])
def test_a_bad_point_names_what_is_wrong(text, message):
    with pytest.raises(SystemExit, match=message):
        diag_points.parse_point(text)


@pytest.mark.parametrize("script", ["bench_ids_dtype", "bench_route", "bench_hf_router", "diag_decode", "diag_fast", "diag_gemm2",
                                    "diag_gemm2_resident", "diag_prefill", "diag_half_tail", "diag_configs",
                                    "diag_gemv_stages", "diag_gemv_gemm2_steps", "diag_quantize_chunks",
                                    "diag_gemv1_reduce", "diag_gemv2_input", "diag_flush", "diag_parts",
                                    "diag_gemm2_keep_a"])
def test_each_script_imports_and_parses_its_arguments(script):
    """Each GPU script that reads models or points starts on the CPU (its imports resolve)."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / f"{script}.py"), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


def test_gemm_times_are_printed_with_the_bandwidth_of_the_gemm_they_name(capsys):
    from types import SimpleNamespace

    def timing(us):
        return SimpleNamespace(median_us=us, p20_us=us - 1, p80_us=us + 1)

    times = {"layer": timing(10.0), "gemm1 a": timing(5.0), "gemm2 b": timing(2.0), "gemm2 c": RuntimeError("no room")}
    assert list(diag_points.print_gemm_times(times, 5_000_000, 1_000_000)) == [("layer", 10.0), ("gemm1 a", 5.0), ("gemm2 b", 2.0)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].rstrip().endswith("(p20 9.0 p80 11.0)")  # the layer: no bandwidth
    assert lines[1].endswith("1.00 TB/s") and lines[2].endswith("0.50 TB/s")  # 5 MB in 5 µs, 1 MB in 2 µs
    assert "FAILED no room" in lines[3]



def test_the_keep_a_diagnosis_times_runs_keeping_a_after_the_tables_own_launch():
    """diag_gemm2_keep_a.py: the table's GEMM2 launch kept first (runs of the first length asked
    where it had one tile per program), then distinct launches keeping A that the scheme can run
    and whose kept A and weight stages fit Hopper's shared memory."""
    import diag_gemm2_keep_a
    from moekit.backends.triton import KernelConfig
    from moekit.spec import get_scheme
    from moekit.tune.space import HOPPER_SHARED_MEMORY, kept_a_shared_memory_bytes

    block, channel = get_scheme("fp8-block128"), get_scheme("fp8-channel-token")
    table = KernelConfig(64, 128, 128, 16, 8, 4, OVERLAP=1).with_gemm2(BLOCK_N=64, num_warps=4, num_stages=3, N_TILES=8)
    variants = diag_gemm2_keep_a.keep_a_variants(table, block, 256, (8, 16))
    assert variants[0] == table.with_gemm2(KEEP_A=1)
    first = diag_gemm2_keep_a.keep_a_variants(table.gemm1(), block, 256, (8, 16))[0]
    assert first == table.gemm1().with_gemm2(N_TILES=8, KEEP_A=1)
    assert len(variants) == len(set(variants)) == 24  # widths 64 and 128 (block scales), 2 warps, 3 stages, 2 runs
    assert all(v.KEEP_A2 and v.gemm2_tiles >= 8 and not v.problems(block) for v in variants)
    # GLM-4.5V at TP2: six K steps. On 64 rows the kept A takes 48 KiB and each stage 24 KiB per
    # 32 columns: 32 wide at 2-4 stages, 64 wide at 2-3, on 4 and 8 warps (the table's own 128-wide,
    # 4-stage launch does not fit); on 128 rows (96 KiB of A) 32 wide at 2-4, 64 at 2.
    for rows, count in ((64, 10), (128, 8)):
        glm = KernelConfig(rows, 128, 128, 8, 8, 4)
        deep = diag_gemm2_keep_a.keep_a_variants(glm, channel, 704, (16,))
        assert len(deep) == len(set(deep)) == count, rows
        assert all(kept_a_shared_memory_bytes(v.gemm2(), channel, 704) <= HOPPER_SHARED_MEMORY for v in deep)
        assert {v.gemm2().BLOCK_N for v in deep} == {32, 64} and glm.with_gemm2(N_TILES=16, KEEP_A=1) not in deep


def test_json_is_written_only_where_a_path_was_given(tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    diag_points.write_json(None, [{"us": 1.0}])
    assert list(tmp_path.iterdir()) == []
    diag_points.write_json(str(tmp_path / "out.json"), [{"us": 1.0}])
    assert json.loads((tmp_path / "out.json").read_text()) == [{"us": 1.0}]


def test_the_decode_diagnosis_sweeps_the_gemv_configs_the_tuner_searches(monkeypatch):
    """diag_decode.py compares the tiled layer against the GEMV configs the tables may run: the
    tuner's space (pipelined K loops, K steps of 1024), less those over the device's shared memory."""
    import torch

    import diag_decode
    from moekit.spec import get_scheme
    from moekit.tune import space

    cpu, fp8 = torch.device("cpu"), get_scheme("fp8-block128")
    swept = diag_decode.gemv_sweep(fp8, 8, cpu)  # Hopper's shared memory holds every one of them
    assert [space.config_key(c) for c in swept] == [space.config_key(c) for c in space.gemv_space()]
    assert {c.num_stages for c in swept} == set(space.GEMV_STAGES) and max(c.BLOCK_K for c in swept) == 1024
    asked = []

    def small_device(device):  # 16 KiB: unpipelined loops use none; deep pipelines of wide tiles more
        asked.append(device)
        return 16 * 1024, "test"

    monkeypatch.setattr(space, "shared_memory_limit", small_device)
    small = diag_decode.gemv_sweep(fp8, 8, cpu)
    assert asked == [cpu]
    assert all(space.gemv_shared_memory_bytes(c, fp8, 8) <= 16 * 1024 for c in small)
    dropped = [c for c in space.gemv_space() if c not in small]
    assert dropped and all(c.num_stages > 1 for c in dropped)  # only pipelines are dropped


@pytest.mark.parametrize("block_n,block_k", [(8, 256), (2, 1024), (1, 4096)])
def test_the_gemv1_probe_kernels_compute_what_they_claim(block_n, block_k, device):
    """diag_gemv1_reduce.py's `late` kernel (the same products as the GEMV path's GEMM1, reduced once
    after the K loop) and its `dot` kernel (them on the tensor cores) give gemv.gemv1's output,
    whatever their tiles, but for float32 sums taken in
    another order: an output may then round to the neighbouring bf16 value (one bf16 step, at most
    2**-7 relative, allowed), nothing more; its `read` kernel sums the gate and up
    weights each program reads, nothing else. Hidden 640: a K step of 256 ends half masked, one
    of 4096 reads the whole row in one masked step."""
    import torch

    import diag_gemv1_reduce as probe
    from moekit.backends.triton import KernelConfig, gemv

    from helpers import random_routing, random_weights, random_x

    E, H, N, M, K = 5, 640, 96, 2, 3
    w = random_weights(E, H, N, "fp8-channel-token", device=device)
    _, ids = random_routing(M, E, K, device=device)
    a, a_scale = gemv.quantize_input(random_x(M, H, device=device), w)
    expected = gemv.gemv1(a, a_scale, w, ids, torch.bfloat16, KernelConfig(16, 8, 256, 1, 2, 1, GEMV=1), False)[0]
    late = probe.probe(a, a_scale, w, ids, torch.empty_like(expected), block_n, block_k, 2, 1, False)
    torch.testing.assert_close(late.float(), expected.float(), rtol=2**-7, atol=1e-6)
    # on the tensor cores (column blocks of 16+): the same products, each K step's summed in the
    # tensor cores' order (float32 here; on a GPU their own precision), so the same tolerance
    dot = probe.on_tensor_cores(a, a_scale, w, ids, torch.empty_like(expected), max(16, 8 * block_n),
                                min(block_k, 256), 4, 3)
    torch.testing.assert_close(dot.float(), expected.float(), rtol=2**-7, atol=1e-6)
    read = probe.probe(a, a_scale, w, ids, torch.empty_like(expected), block_n, block_k, 2, 1, True)
    w13 = w.w13.float()[ids.reshape(-1).long()]  # [P, 2N, H]: each pair's expert
    sums = (w13[:, :N].sum(dim=2) + w13[:, N:].sum(dim=2)).to(torch.bfloat16)
    assert torch.allclose(read.float(), sums.float(), rtol=1e-2, atol=1e-2)  # float32 sums of 1280 values, in another order


def test_the_gemv2_input_probe_runs_each_input_it_times(device):
    """diag_gemv2_input.py's inputs: the bf16 intermediate quantized per group (the backend's own),
    per row, unquantized, and already FP8 with a per-tensor scale, each through gemv.gemv2 with its
    A_MODE. Each stays near the group rule's output (the script's own check, 5e-2 relative L2:
    other quantizations of the same values, each within a few FP8 steps), and the unquantized one
    differs from it (the probe would time nothing new otherwise)."""
    import torch

    import diag_gemv2_input as probe
    from moekit.backends.triton import KernelConfig, gemv

    from helpers import random_routing, random_weights, random_x, rel_l2

    E, H, N, M, K = 5, 256, 320, 2, 3
    w = random_weights(E, H, N, "fp8-channel-token", device=device)
    tw, ids = random_routing(M, E, K, device=device)
    cfg = KernelConfig(16, 8, 256, 1, 2, 1, GEMV=1)
    a, a_scale = gemv.quantize_input(random_x(M, H, device=device), w)
    act, act_scale, a_mode = gemv.gemv1(a, a_scale, w, ids, torch.bfloat16, cfg, False)
    assert a_mode == probe.A_MODES["group"]
    expected = gemv.gemv2(act, act_scale, a_mode, w, tw.float(), ids, torch.bfloat16, cfg)
    outs = {kind: gemv.gemv2(act_in, scale, probe.A_MODES[kind], w, tw.float(), ids, torch.bfloat16, cfg)
            for kind, (act_in, scale) in probe.inputs(act).items()}
    assert torch.equal(outs["group"], expected)
    assert outs["fp8"].dtype == torch.bfloat16 and probe.inputs(act)["fp8"][0].dtype == torch.float8_e4m3fn
    for kind, out in outs.items():
        assert rel_l2(out, expected) < 5e-2, kind
    assert not torch.equal(outs["bf16"], expected)


@pytest.mark.parametrize("gemv", [0, 1])
def test_the_flush_probe_times_the_layer_its_gemms_and_reads_of_their_bytes(gemv, device, monkeypatch):
    """diag_flush.py's closures on a small problem: the layer with the config given (its output the
    backend's), GEMM1 and GEMM2 alone where that config is a GEMV one (their composition is the
    layer's output, bit for bit: the same launches), and the bare reads of as many bytes as the
    used experts' weights (their counts are those bytes)."""
    import torch
    from types import SimpleNamespace

    import diag_flush as probe
    import moekit
    from moekit.backends.triton import KernelConfig

    from helpers import random_routing, random_weights, random_x

    E, H, N, M, K = 5, 256, 320, 2, 3
    w = random_weights(E, H, N, "fp8-channel-token", device=device)
    tw, ids = random_routing(M, E, K, device=device)
    p = SimpleNamespace(w=w, x=random_x(M, H, device=device), tw=tw.float(), ids=ids, M=M, shape=SimpleNamespace(top_k=K))
    cfg = KernelConfig(16, 8, 256, 1, 2, 1, GEMV=1) if gemv else KernelConfig(16, 32, 128, 1, 2, 1)
    backend = moekit.get_backend("triton")
    monkeypatch.setattr(backend, "config_for", lambda *args: cfg)
    fns, bytes1, bytes2 = probe.closures(backend, p, device)
    used = int(torch.unique(ids).numel())
    assert (bytes1, bytes2) == (used * 2 * N * H, used * H * N)  # one byte per FP8 weight
    assert set(fns) == {"layer", "read w13", "read w2"} | ({"gemm1", "gemm2"} if gemv else set())
    out = fns["layer"]()
    assert torch.equal(out, backend.run(p.x, w, p.tw, ids, config=cfg))
    assert int(fns["read w13"]()) == int(w.w13[:used].view(torch.int32).max())
    assert int(fns["read w2"]()) == int(w.w2[:used].view(torch.int32).max())
    if gemv:  # GEMM2 alone runs on the intermediate made once; GEMM1 alone makes that intermediate again
        from moekit.backends.triton import gemv as gemv_module

        act, act_scale, a_mode = fns["gemm1"]()
        assert torch.equal(gemv_module.gemv2(act, act_scale, a_mode, w, p.tw, ids, p.x.dtype, cfg), out)
        assert torch.equal(fns["gemm2"](), out)


def test_the_parts_probe_times_the_layers_own_launches(device):
    """diag_parts.py's closures on a small tiled problem: the layer is the backend's, and the
    parts, run in order (align, quantize x, GEMM1, GEMM2, combine), give the layer's output bit
    for bit (at 21 pairs the layer itself joins the alignment to x's quantization in one launch:
    the same alignment and values); the gemm-mode closure gives GEMM2's pair rows."""
    import torch
    from types import SimpleNamespace

    import diag_parts as probe
    import moekit
    from moekit.backends.triton import KernelConfig, launch

    from helpers import random_routing, random_weights, random_x

    E, H, N, M, K = 5, 256, 320, 7, 3
    w = random_weights(E, H, N, "fp8-channel-token", device=device)
    tw, ids = random_routing(M, E, K, device=device)
    p = SimpleNamespace(w=w, x=random_x(M, H, device=device), tw=tw.float(), ids=ids, M=M, shape=SimpleNamespace(top_k=K))
    cfg = KernelConfig(16, 32, 128, 1, 2, 1)
    backend = moekit.get_backend("triton")
    fns = probe.parts(backend, p, cfg)
    assert set(fns) == {"layer", "gemms", "align", "quantize x", "gemm1", "gemm2", "combine"}
    out = fns["layer"]()
    assert torch.equal(out, backend.run(p.x, w, p.tw, ids, config=cfg))
    align = fns["align"]()
    a, a_scale = fns["quantize x"]()
    pairs = launch.gemm2(launch.gemm1(a, a_scale, w, align, K, p.x.dtype, cfg), w, align, p.tw, p.x.dtype, cfg)
    assert torch.equal(launch.combine(pairs, M, K), out)
    assert torch.equal(fns["gemms"](), pairs)
    # the probe's own GEMM closures, on the inputs it made once
    assert torch.equal(launch.gemm2(fns["gemm1"](), w, align, p.tw, p.x.dtype, cfg), pairs)
    assert torch.equal(fns["gemm2"](), pairs)
    assert torch.equal(fns["combine"](), out)


def test_the_gemv_scripts_take_the_tables_gemv_config_else_the_start():
    from types import SimpleNamespace

    from moekit.backends.triton import KernelConfig
    from moekit.tune.space import GEMV_START

    point = SimpleNamespace(w="weights", shape=SimpleNamespace(top_k=8), M=2)
    late = KernelConfig(BLOCK_M=16, BLOCK_N=4, BLOCK_K=512, GROUP_M=1, num_warps=4, num_stages=3, GEMV=2)
    for table, expected in ((late, late), (KernelConfig(16, 64, 128, 1, 4, 3), GEMV_START)):
        backend = SimpleNamespace(config_for=lambda w, top_k, M, dev, table=table: table)
        assert diag_points.gemv_config(backend, point, "cuda") == expected
