"""Calls of more (token, expert) pairs than one alignment takes (launch.MAX_ALIGN_PAIRS): the
triton backend's run() splits the tokens into consecutive slices, each a normal call. On the CPU
the limit is patched small, so a few dozen tokens span several slices."""

import json
import re

import pytest
import torch
import triton
import triton.language as tl

import moekit
from moekit.backends.triton import KernelConfig, launch
from moekit.backends.triton import _kernels as k

from helpers import compile_in_child, random_routing, random_weights, random_x, rel_l2
from test_triton_backend import REL_L2_TOL, assert_matches_reference, reference_for


@pytest.mark.parametrize("E", [3, 40])
def test_the_scan_runs_at_the_limit(device, E):
    """The scan as align_pairs launches it at launch.MAX_ALIGN_PAIRS pairs: over SCAN_MAX_CHUNKS chunks
    in one tile per program (Triton's tile limit allows it), a program per SCAN_E_BLOCK experts (40:
    three, the last one partial); it runs, prefixes every chunk's counts and totals every expert,
    each expert's own (counts differing per expert and chunk). One program (3 experts) also writes
    the counts and padded starts; several leave them to align_starts_kernel. Which launches
    align_pairs itself makes: test_align_pairs_scans_a_program_per_16_experts_and_pads_once."""
    chunks = launch.SCAN_MAX_CHUNKS
    assert launch.MAX_ALIGN_PAIRS == launch.CHUNK * chunks
    assert chunks * launch.SCAN_E_BLOCK <= tl.TRITON_MAX_TENSOR_NUMEL
    counts = (torch.arange(chunks, device=device)[:, None] % 3 + torch.arange(E, device=device)[None, :]).int()
    expected_prefix = torch.cumsum(counts, dim=0) - counts
    total, count, start = (torch.full((n,), -1, dtype=torch.int32, device=device) for n in (E, E, E + 1))
    programs = triton.cdiv(E, launch.SCAN_E_BLOCK)
    launch._launch(k.align_scan_kernel, (programs,), counts, total, count, start, chunks, E, BLOCK_M=16,
                   C_POW2=triton.next_power_of_2(chunks), E_BLOCK=launch.SCAN_E_BLOCK, WITH_STARTS=programs == 1)
    assert torch.equal(counts, expected_prefix)
    expected_total = expected_prefix[-1] + (torch.arange(E, device=device) + (chunks - 1) % 3).int()
    assert torch.equal(total, expected_total)
    if programs > 1:  # the starts are the next kernel's (align_pairs launches it): none written here
        assert (count == -1).all() and (start == -1).all()
        launch._launch(k.align_starts_kernel, (1,), total, count, start, E, BLOCK_M=16, E_BLOCK=launch.E_BLOCK)
    padded = (expected_total + 15) // 16 * 16
    assert torch.equal(count, expected_total)
    assert torch.equal(start, torch.cat([torch.zeros(1, dtype=torch.int32, device=device), torch.cumsum(padded, 0).int()]))


@pytest.mark.parametrize("E", [3, 15, 16, 17, 32, 33, 70])
def test_align_pairs_scans_a_program_per_16_experts_and_pads_once(E, monkeypatch, device):
    """align_pairs over several chunks launches count, scan on cdiv(E, SCAN_E_BLOCK) programs,
    then scatter; where the scan is one program (E <= SCAN_E_BLOCK: 16 exactly included) that
    program writes the counts and padded starts itself (WITH_STARTS) and nothing more is launched;
    where it is several, none of them does (a program would read totals that others may not have
    written yet) and align_starts_kernel runs between the scan and the scatter. The interpreter runs
    a grid's programs one after another, so a wrong choice here still gives the right alignment on
    the CPU: the launches themselves are checked, and then the alignment (a padded stable sort).
    (Written by a review's mutants: WITH_STARTS always on, or off at 16 experts, or no starts
    launch at 17-32 experts all passed every other test.)"""
    programs = triton.cdiv(E, launch.SCAN_E_BLOCK)
    expected = ["align_count_kernel", "align_scan_kernel"] + (["align_starts_kernel"] if programs > 1 else []) \
        + ["align_scatter_kernel"]
    launches = []
    original = launch._launch

    def spy(kernel, grid, *args, **kwargs):
        launches.append((kernel.__name__, tuple(grid), kwargs.get("WITH_STARTS")))
        if kernel.__name__ == "align_scatter_kernel":  # checked before it runs: wrong starts would scatter out of bounds
            assert [name for name, _, _ in launches] == expected
            assert launches[1][1:] == ((programs,), programs == 1)  # the scan's grid and WITH_STARTS
        return original(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "_launch", spy)
    P = 3 * launch.CHUNK + 5  # four chunks, the last one partial
    assert P > launch.SINGLE_ALIGN_MAX_PAIRS
    g = torch.Generator().manual_seed(E)
    ids = torch.randint(0, E, (P,), generator=g, dtype=torch.int32)
    ids[:E] = torch.arange(E, dtype=torch.int32)  # every expert has pairs, the last block's included
    al = launch.align_pairs(ids.view(-1, 1).to(device), E, 16)
    assert [name for name, _, _ in launches] == expected

    count, start = al.count.cpu(), al.start.cpu()
    assert torch.equal(count, torch.bincount(ids.long(), minlength=E).int())
    padded = (count + 15) // 16 * 16
    assert start[0] == 0 and torch.equal(start[1:] - start[:-1], padded)
    pairs = al.sorted_pairs.cpu()
    for e in range(E):
        assert torch.equal(pairs[start[e] : start[e] + count[e]], torch.nonzero(ids == e).flatten().int())


_SCAN_TTIR = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moekit.backends.triton import _kernels as k, launch
names = list(k.align_scan_kernel.arg_names)
signature = dict.fromkeys(names[:4], "*i32") | dict.fromkeys(names[4:6], "i32") | dict.fromkeys(names[6:], "constexpr")
ttir = {}
for with_starts in (True, False):
    constants = {"BLOCK_M": 16, "C_POW2": 64, "E_BLOCK": launch.SCAN_E_BLOCK, "WITH_STARTS": with_starts, "PDL": False}
    source = ASTSource(k.align_scan_kernel, signature, {(names.index(n),): v for n, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ttir[str(with_starts)] = compiled.asm["ttir"]
json.dump(ttir, sys.stdout)
"""


def test_the_one_program_scan_waits_for_its_totals_before_reading_them():
    """WITH_STARTS: align_scan_kernel stores each expert's total, then _padded_starts loads them
    back, in other threads of the program than stored them: a barrier must come between (the
    interpreter runs a program as one thread, so no CPU run notices a missing one; a review's
    mutant without it passed every other test). Compiled for sm_90 in a process of its own, the
    kernel's memory operations in order: the counts' load, the prefix's and the totals' stores,
    the barrier, then the starts' load of the totals. Without WITH_STARTS the kernel reads nothing
    back and needs none."""
    ttir = json.loads(compile_in_child(["-c", _SCAN_TTIR], timeout=600))

    def memory_ops(text):
        return re.findall(r"\b(tt\.load|tt\.store|(?:gpu|ttg)\.barrier)\b", text)

    with_starts = memory_ops(ttir["True"])
    assert with_starts[:3] == ["tt.load", "tt.store", "tt.store"], with_starts
    assert with_starts[3].endswith(".barrier") and with_starts[4] == "tt.load", with_starts
    assert memory_ops(ttir["False"]) == ["tt.load", "tt.store", "tt.store"]


# Shared memory per block: sm_89 (Ada, the oldest FP8 GPU the backend supports) 99 KiB, sm_90 227.
SHARED_PER_BLOCK = {89: 99 * 1024, 90: 227 * 1024}
_COMPILE_SCAN = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moekit.backends.triton import _kernels as k, launch
names = list(k.align_scan_kernel.arg_names)
signature = dict.fromkeys(names[:4], "*i32") | dict.fromkeys(names[4:6], "i32") | dict.fromkeys(names[6:], "constexpr")
shared = {}
for cap in (89, 90):
    for chunks in (launch.SCAN_MAX_CHUNKS // 2, launch.SCAN_MAX_CHUNKS):
        constants = {"BLOCK_M": 64, "C_POW2": chunks, "E_BLOCK": launch.SCAN_E_BLOCK, "WITH_STARTS": True}
        source = ASTSource(k.align_scan_kernel, signature, {(names.index(n),): v for n, v in constants.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", cap, 32), options={"num_warps": 4})
        shared[f"{cap}-{chunks}"] = compiled.metadata.shared
json.dump(shared, sys.stdout)
"""


def test_the_scan_at_the_limit_fits_shared_memory():
    """SCAN_MAX_CHUNKS is what fits: compiled for sm_89 and sm_90 (without a GPU, in a process of
    its own: under TRITON_INTERPRET Triton compiles nothing), the scan's shared memory grows
    linearly with its chunks (checked at half the limit), fits both GPUs' blocks at the limit, and
    twice the limit (the next power of two) would not fit sm_89's. 2**23 pairs, the limit Triton's
    tile size alone allowed, asked for 2 MiB and failed at launch on every GPU."""
    shared = json.loads(compile_in_child(["-c", _COMPILE_SCAN], timeout=600))
    half, full = launch.SCAN_MAX_CHUNKS // 2, launch.SCAN_MAX_CHUNKS
    for cap, budget in SHARED_PER_BLOCK.items():
        assert shared[f"{cap}-{full}"] == 2 * shared[f"{cap}-{half}"], shared  # linear in the chunks
        assert shared[f"{cap}-{full}"] <= budget, shared
    assert 2 * shared[f"89-{full}"] > SHARED_PER_BLOCK[89], shared


def test_align_pairs_refuses_more_than_the_limit():
    ids = torch.zeros(launch.MAX_ALIGN_PAIRS + 1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="MAX_ALIGN_PAIRS"):
        launch.align_pairs(ids, 4, 16)


@pytest.mark.parametrize("M,K,expected", [
    (launch.MAX_ALIGN_PAIRS // 8, 8, None),  # at the limit (M = 2**15 at top-8): one call, not split
    (launch.MAX_ALIGN_PAIRS // 8 + 1, 8, [2**14 + 1, 2**14]),
    (launch.MAX_ALIGN_PAIRS + 1, 1, [2**17 + 1, 2**17]),
    (2 * (launch.MAX_ALIGN_PAIRS // 6) + 3, 6, [29128, 29128, 29127]),  # 43,690 tokens fit at top-6
])
def test_slices_at_the_real_limit(monkeypatch, M, K, expected):
    """Where run() splits and how (the calls recorded, not run): consecutive slices in order,
    sizes differing by at most one row, none over the limit, covering every row once."""
    calls = []

    def fake_run(self, x, weights, topk_weights, topk_ids, config, out=None):
        calls.append((x.data_ptr(), topk_ids.data_ptr(), topk_weights.shape[0], topk_ids.shape[0], x.shape[0]))
        if out is not None:
            out.fill_(len(calls))
        return out

    monkeypatch.setattr(launch.TritonBackend, "_run", fake_run)
    w = random_weights(2, 1, 16, "bf16")  # hidden 1: the [M, H] buffers stay small
    x = torch.empty(M, 1, dtype=torch.bfloat16)
    ids = torch.empty(M, K, dtype=torch.int32)
    tw = torch.empty(1, 1).expand(M, K)
    out = moekit.get_backend("triton").run(x, w, tw, ids)
    if expected is None:
        assert out is None and len(calls) == 1 and calls[0][2:] == (M, M, M)
        return
    assert sum(expected) == M and max(expected) * K <= launch.MAX_ALIGN_PAIRS
    assert [c[2:] for c in calls] == [(n, n, n) for n in expected]
    starts = [sum(expected[:i]) for i in range(len(expected))]
    assert [c[0] for c in calls] == [x.data_ptr() + s * x.element_size() for s in starts]
    assert [c[1] for c in calls] == [ids.data_ptr() + s * K * ids.element_size() for s in starts]
    assert out.shape == (M, 1) and out.dtype == x.dtype
    assert torch.equal(out[:, 0], torch.repeat_interleave(torch.arange(1, len(expected) + 1), torch.tensor(expected)).to(out.dtype))


def _problem(scheme, M, K, E, experts, device, seed=0):
    w = random_weights(E, 128, 128, scheme, device=device, seed=seed)
    tw, ids = random_routing(M, E, K, device=device, seed=seed, experts=experts)
    return random_x(M, 128, device=device, seed=seed), w, tw, ids


# (top-k, experts of which some idle, patched limit, M): 3 slices each, of odd and even sizes, with
# more than 128 pairs each (the count / scan / scatter alignment, as at the real limit)
SPLITS = [
    (8, 10, [0, 1, 2, 3, 5, 6, 7, 9], 256, 77),  # slices of 26, 26 and 25 tokens; experts 4, 8 idle
    (1, 5, [0, 1, 3, 4], 140, 391),  # slices of 131, 130, 130 tokens; expert 2 idle
]


@pytest.mark.parametrize("scheme", ["bf16", "fp8-channel-token"])
@pytest.mark.parametrize("K,E,experts,limit,M", SPLITS)
def test_split_call_is_bitwise_one_call(monkeypatch, scheme, K, E, experts, limit, M, device):
    x, w, tw, ids = _problem(scheme, M, K, E, experts, device)
    backend = moekit.get_backend("triton")
    one_call = backend.run(x, w, tw, ids)
    slices = triton.cdiv(M, limit // K)
    # each slice looks up its own M's config: the same as one call's at these sizes (the analytic
    # default, 16+ rows per expert), so the split must not change a bit
    sizes = {M // slices, triton.cdiv(M, slices)}
    assert {backend.config_for(w, K, m, x.device) for m in sizes} == {backend.config_for(w, K, M, x.device)}
    looked_up = []
    config_for = launch.TritonBackend.config_for
    monkeypatch.setattr(launch.TritonBackend, "config_for",
                        lambda self, w_, k_, m, d: looked_up.append(m) or config_for(self, w_, k_, m, d))
    monkeypatch.setattr(launch, "MAX_ALIGN_PAIRS", limit)
    split = backend.run(x, w, tw, ids)
    assert sorted(looked_up) == sorted([M // slices + (i < M % slices) for i in range(slices)])
    assert max(looked_up) * K <= limit
    assert torch.equal(split, one_call)
    assert_matches_reference(split, x, w, tw, ids)


def test_split_call_with_a_given_config_and_decode_sized_slices(monkeypatch, device):
    """A config given to run() runs every slice. One call of 180 pairs aligns them in the
    count / scan / scatter kernels; slices of at most 128 align and quantize in one launch
    (align_and_quantize): still one call's bits."""
    x, w, tw, ids = _problem("fp8-block128", 45, 4, 6, [0, 2, 3, 5], device, seed=1)
    backend = moekit.get_backend("triton")
    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1)
    one_call = backend.run(x, w, tw, ids, config=cfg)
    monkeypatch.setattr(launch, "MAX_ALIGN_PAIRS", 64)  # 3 slices of 15 tokens (60 pairs)
    monkeypatch.setattr(launch.TritonBackend, "config_for", lambda *a: pytest.fail("a given config is looked up"))
    assert torch.equal(backend.run(x, w, tw, ids, config=cfg), one_call)


def test_split_call_of_the_gemv_path(monkeypatch, device):
    x, w, tw, ids = _problem("fp8-block128", 9, 2, 5, None, device, seed=2)
    backend = moekit.get_backend("triton")
    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_stages=1, GEMV=1)
    one_call = backend.run(x, w, tw, ids, config=cfg)
    monkeypatch.setattr(launch, "MAX_ALIGN_PAIRS", 8)  # slices of 3 tokens
    assert torch.equal(backend.run(x, w, tw, ids, config=cfg), one_call)


def test_split_call_of_a_dynamic_per_tensor_scale(monkeypatch, device):
    """fp8-tensor-dynamic: each slice quantizes with scales of its own (input and intermediate),
    so the split call is the slices' own calls, each as close to its reference as one call."""
    x, w, tw, ids = _problem("fp8-tensor-dynamic", 77, 8, 10, [0, 1, 2, 3, 5, 6, 7, 9], device)
    backend = moekit.get_backend("triton")
    parts = [(0, 26), (26, 52), (52, 77)]
    own = [backend.run(x[a:b], w, tw[a:b], ids[a:b]) for a, b in parts]
    monkeypatch.setattr(launch, "MAX_ALIGN_PAIRS", 256)
    split = backend.run(x, w, tw, ids)
    assert torch.equal(split, torch.cat(own))
    for (a, b), part in zip(parts, own):
        assert rel_l2(part, reference_for(x[a:b], w, tw[a:b], ids[a:b])) < REL_L2_TOL
