"""The routing kernel: router logits to each token's top-k experts and weights in one launch.

Only @triton.jit code lives here; fused.py launches it. The rule is route()'s (routing/__init__.py),
step for step, so that the torch path there is this kernel's reference: scores by softmax or
sigmoid, an optional correction bias on the choice, grouped top-k, top-k, the unbiased scores as
weights, renormalization and the scaling factor.
"""

import triton
import triton.language as tl

from ..backends.triton._kernels import _pdl_enter

# the accurate expf torch's own kernels use (the CPU interpreter has none: it returns None there)
from triton.language.extra.libdevice import exp as _libdevice_exp


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    """e**x rounded as torch rounds it (libdevice's expf) on a GPU; `tl.exp` there is the
    approximate ex2 and would move scores by a few ulps, enough to reorder near-equal experts
    against the torch path. The interpreter's exp is numpy's, already accurate."""
    if INTERPRET:
        return tl.exp(x)
    else:
        return _libdevice_exp(x)


@triton.jit
def _best_index(values, cols, NO_INDEX: tl.constexpr):
    """Per row, the lowest column holding the row's maximum (values are never NaN here)."""
    best = tl.max(values, axis=1)
    return tl.min(tl.where(values == best[:, None], cols[None, :], NO_INDEX), axis=1)


@triton.jit
def route_kernel(
    logits_ptr, stride_m, stride_e, bias_ptr, weights_ptr, ids_ptr,
    M, E, K, num_groups, topk_groups, group_size, scaling,
    SOFTMAX: tl.constexpr,  # else sigmoid
    HAS_BIAS: tl.constexpr,  # choose on scores + bias
    CHOOSE_ON_LOGITS: tl.constexpr,  # sigmoid without bias or groups: choose on the raw logits
    GROUPED: tl.constexpr,  # keep only the topk_groups best of num_groups groups
    RENORMALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, G_PAD: tl.constexpr,
    RENORM_EPS: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """BLOCK_M tokens per program, each token's E logits in one row of an [BLOCK_M, E_PAD] tile.

    Writes weights float32 [M, K] and ids int32 [M, K], each row ordered by decreasing choice.
    Asserts that every logit is finite (compiled in with Triton's `debug`, fused.py), as route()'s
    torch path does with torch._assert_async.

    With PDL (programmatic dependent launch, as the triton backend's kernels: MOEKIT_PDL) it waits
    for the kernel before it (the router's GEMM) and lets the next one start at once: the triton
    backend's first kernel then launches during this one and waits on the device for its ids.
    """
    _pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < M
    col_ok = cols < E
    ok = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None].to(tl.int64) * stride_m + cols[None, :].to(tl.int64) * stride_e  # strides of any size
    logits = tl.load(logits_ptr + offsets, mask=ok, other=0.0).to(tl.float32)  # masked off: 0, finite
    tl.device_assert(tl.abs(logits) < float("inf"),
                     "moekit.route: router_logits has NaN or inf values (or float64 values beyond float32's range)")

    if SOFTMAX:
        shifted = tl.where(col_ok[None, :], logits, float("-inf"))
        exps = _exp(shifted - tl.max(shifted, axis=1)[:, None], INTERPRET)  # padding: exp(-inf) = 0
        scores = tl.div_rn(exps, tl.sum(exps, axis=1)[:, None])  # IEEE division, as torch divides
    else:
        scores = tl.div_rn(1.0, 1.0 + _exp(-logits, INTERPRET))
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
        # route() checks a bias once per version on the host side; a write through .data keeps
        # the version, so the kernel, which reads the bias anyway, checks it too
        tl.device_assert(tl.abs(bias) < float("inf"), "moekit.route: correction_bias has NaN or inf values")
        choice = scores + bias[None, :]
    elif CHOOSE_ON_LOGITS:
        choice = logits
    else:
        choice = scores
    choice = tl.where(col_ok[None, :], choice, float("-inf"))  # padding is never chosen

    if GROUPED:
        # a group's score: the sum of its two best choice values (the best removed by position, so
        # a tie counts twice, as torch.topk(2).values.sum() counts it)
        group_of_col = cols // group_size  # padding columns fall in no real group
        groups = tl.arange(0, G_PAD)
        group_scores = tl.full((BLOCK_M, G_PAD), float("-inf"), tl.float32)
        for g in range(num_groups):
            members = tl.where(group_of_col[None, :] == g, choice, float("-inf"))
            first = _best_index(members, cols, E_PAD)
            best = tl.max(members, axis=1)
            second = tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), members), axis=1)
            group_scores = tl.where(groups[None, :] == g, (best + second)[:, None], group_scores)
        kept = tl.zeros((BLOCK_M, E_PAD), tl.int1)
        for _ in range(topk_groups):
            g_best = _best_index(group_scores, groups, G_PAD)
            kept = kept | (group_of_col[None, :] == g_best[:, None])
            group_scores = tl.where(groups[None, :] == g_best[:, None], float("-inf"), group_scores)
        choice = tl.where(kept, choice, float("-inf"))

    # top-k, best first: take the best column, note its id and unbiased score, rule it out
    slots = tl.arange(0, K_PAD)
    ids = tl.zeros((BLOCK_M, K_PAD), tl.int32)
    weights = tl.zeros((BLOCK_M, K_PAD), tl.float32)
    for j in range(K):
        chosen = _best_index(choice, cols, E_PAD)
        is_chosen = cols[None, :] == chosen[:, None]
        weight = tl.sum(tl.where(is_chosen, scores, 0.0), axis=1)
        ids = tl.where(slots[None, :] == j, chosen[:, None], ids)
        weights = tl.where(slots[None, :] == j, weight[:, None], weights)
        choice = tl.where(is_chosen, float("-inf"), choice)

    if RENORMALIZE:  # + route()'s epsilon: sigmoid weights can all underflow to 0
        weights = tl.div_rn(weights, tl.sum(weights, axis=1)[:, None] + RENORM_EPS)
    weights = weights * scaling
    out = rows[:, None].to(tl.int64) * K + slots[None, :]
    out_ok = row_ok[:, None] & (slots[None, :] < K)
    tl.store(weights_ptr + out, weights, mask=out_ok)
    tl.store(ids_ptr + out, ids, mask=out_ok)
