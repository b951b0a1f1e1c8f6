"""transformers' routers run through moekit.route (moekit/hf/routers.py): the same routing and the
same outputs as transformers' own routers on every family, the check that refuses a router that
routes otherwise, and the swap back.

On the CPU route() runs its torch ops, the same float32 formulas as transformers' routers, so the
tiny models (top-2: a sum of two terms has one rounding whatever the order) are compared bitwise
here; with more terms the renormalization sum's order may move a weight's last bits. On a GPU (test_fused_routers_on_gpu) the routing
kernel's last bits and tie-breaking may differ, and the model's output is compared within the
experts' own tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import moekit.hf as mh  # noqa: E402
from moekit.hf import routers as R  # noqa: E402
from moekit.hf.families import UnsupportedModelError  # noqa: E402

from test_hf_tiny import FAMILY_NAMES, HIDDEN, VOCAB, tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _routers(model):
    return [m for m in model.modules() if R.family_of_router(m) is not None]


def _tokens(seed=0, shape=(2, 11)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fused_router_keeps_transformers_contract(family):
    """Each fused router returns what transformers' returns, in the same structure: the same
    logits, the same experts per token, the same weights (bitwise on the CPU), in the same dtype;
    ids in int32 ordered by decreasing choice."""
    model = mh.patch_model(tiny_model(family), backend="reference")
    routers = _routers(model)
    assert routers, f"{family}: the tiny model has no router"
    g = torch.Generator().manual_seed(1)
    hidden = (torch.randn(37, HIDDEN, generator=g) * 2).to(torch.bfloat16)  # odd count, spread logits
    with torch.no_grad():
        before = [r(hidden) for r in routers]
        assert mh.fuse_routers(model) == len(routers)
        after = [r(hidden) for r in routers]
    for r, want, got in zip(routers, before, after):
        assert R.is_fused(r) and isinstance(r, R.family_of_router(r).original_class(type(r).moekit_original.__name__))
        if R.RULES[family].dense_scores:  # Llama-4: (scores [T, E], logits) -> (RoutedExperts, logits)
            scores, logits_hf = want
            (weights, ids), logits = got
            ids_hf = torch.topk(logits_hf, r.top_k, dim=-1).indices
            w_hf = scores.gather(-1, ids_hf)
        else:
            logits_hf, w_hf, ids_hf = want
            logits, weights, ids = got
        assert torch.equal(logits, logits_hf)
        assert ids.dtype == torch.int32 and weights.dtype == w_hf.dtype
        ids_sorted, order = ids.long().sort(-1)
        ids_hf_sorted, order_hf = ids_hf.sort(-1)
        assert torch.equal(ids_sorted, ids_hf_sorted)
        assert torch.equal(weights.gather(-1, order), w_hf.gather(-1, order_hf))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_model_output_unchanged_and_swap_back(family):
    """A whole model with fused routers gives transformers' output bitwise on the CPU (reference
    experts on both sides); unfuse_routers restores the original classes and the state dict is the
    same throughout."""
    model = mh.patch_model(tiny_model(family), backend="reference")
    tokens = _tokens()
    keys = list(model.state_dict())
    classes = [type(r) for r in _routers(model)]
    with torch.no_grad():
        want = model(tokens).logits
        mh.fuse_routers(model)
        got = model(tokens).logits
        assert list(model.state_dict()) == keys
        assert mh.unfuse_routers(model) == len(classes)
        back = model(tokens).logits
    assert torch.equal(got, want) and torch.equal(back, want)
    assert [type(r) for r in _routers(model)] == classes


def test_glm45v_text_router():
    """GLM-4.5V's text router (no tiny model of the family here): built alone with 4 groups of 4
    experts, 2 kept, top-4, a scaling factor and a random bias, inside a container module; fused,
    it returns transformers' logits bitwise and its experts and weights on the CPU."""
    import transformers as T
    from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextTopkRouter

    config = T.Glm4vMoeTextConfig(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                  topk_group=2, routed_scaling_factor=2.0, norm_topk_prob=True)
    g = torch.Generator().manual_seed(3)
    # the router beside moekit's experts, as in a patched model (fuse_routers refuses it otherwise)
    model = torch.nn.ModuleDict({"gate": Glm4vMoeTextTopkRouter(config), "experts": mh.MoekitExperts(16, HIDDEN, 32)})
    with torch.no_grad():
        model.gate.weight.copy_(torch.randn(16, HIDDEN, generator=g) * 0.2)
        model.gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.1)
    hidden = torch.randn(29, HIDDEN, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        logits_hf, w_hf, ids_hf = model.gate(hidden)
        assert mh.fuse_routers(model, dtype=torch.bfloat16) == 1
        logits, w, ids = model.gate(hidden)
    assert type(model.gate).__name__ == "FusedGlm4vMoeTextTopkRouter"
    assert torch.equal(logits, logits_hf)
    ids_sorted, order = ids.long().sort(-1)
    ids_hf_sorted, order_hf = ids_hf.sort(-1)
    assert torch.equal(ids_sorted, ids_hf_sorted)
    # the same weights up to the renormalization sum's order (transformers sums its unsorted top-k,
    # route() its sorted top-k): 4 terms, a few float32 ulps (~1.2e-7 each) at most
    torch.testing.assert_close(w.gather(-1, order), w_hf.gather(-1, order_hf), rtol=5e-7, atol=0)


def test_router_logits_still_recorded():
    """output_router_logits records the fused routers' logits, as transformers' (its recorder
    hooks the router class, of which the fused class is a subclass)."""
    model = mh.patch_model(tiny_model("mixtral"), backend="reference")
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens, output_router_logits=True).router_logits
        mh.fuse_routers(model)
        got = model(tokens, output_router_logits=True).router_logits
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_patch_model_fused_routing_and_fuse_twice():
    model = mh.patch_model(tiny_model("qwen3_moe"), backend="reference", fused_routing=True)
    assert all(R.is_fused(r) for r in _routers(model)) and len(_routers(model)) == 2
    assert mh.fuse_routers(model) == 0  # already fused: nothing swapped, no error


def test_a_router_that_routes_otherwise_is_refused(monkeypatch):
    """A transformers whose router follows another rule than moekit's for its family (simulated:
    moekit's rule without the groups and the correction bias) is refused by the check, naming
    the router and what differs, and nothing is swapped; patch_model leaves the experts too."""
    model = tiny_model("deepseek_v3")
    for m in model.modules():  # a large bias that moves the choice (transformers' rule uses it)
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.copy_(torch.linspace(0.5, -0.5, m.e_score_correction_bias.numel()))
    monkeypatch.setitem(R.RULES, "deepseek_v3", R.RouterRule("sigmoid", renormalize="norm_topk_prob",
                                                                float32_logits=True))
    experts_before = {n: type(m) for n, m in model.named_modules() if n.endswith(".experts")}
    with pytest.raises(UnsupportedModelError, match=r"mlp\.gate \(DeepseekV3TopkRouter\): \d+ of 64 random tokens "
                       r"chose other experts.*leave fused_routing off"):
        mh.patch_model(model, backend="reference", fused_routing=True)
    assert not any(R.is_fused(r) for r in _routers(model))
    assert {n: type(m) for n, m in model.named_modules() if n.endswith(".experts")} == experts_before


def test_weights_that_differ_are_refused(monkeypatch):
    """Qwen3 renormalizes (norm_topk_prob=True in the tiny config); a rule that does not gives the
    same experts with other weights: refused, with the size of the difference."""
    model = mh.patch_model(tiny_model("qwen3_moe"), backend="reference")
    monkeypatch.setitem(R.RULES, "qwen3_moe", R.RouterRule("softmax", renormalize=False, weights_in_logits_dtype=True))
    with pytest.raises(UnsupportedModelError, match=r"weights differ from transformers' by .* relative"):
        mh.fuse_routers(model)
    assert not any(R.is_fused(r) for r in _routers(model))


def test_router_without_an_expected_attribute():
    model = mh.patch_model(tiny_model("glm4_moe"), backend="reference")
    router = _routers(model)[0]
    del router.routed_scaling_factor
    with pytest.raises(UnsupportedModelError, match=r"Glm4MoeTopkRouter has no attribute 'routed_scaling_factor'"):
        mh.fuse_routers(model)


def test_a_model_without_routers():
    with pytest.raises(UnsupportedModelError, match="has no router of a family moekit can route"):
        mh.fuse_routers(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def _all_tied_deepseek_router():
    """A DeepSeek-V3 router whose logits all tie (equal rows of the weight, no bias): on every
    token any two experts of one group are a right top-2."""
    router = _routers(tiny_model("deepseek_v3"))[0]
    with torch.no_grad():
        router.weight.fill_(0.01)
        router.e_score_correction_bias.zero_()
    return router, R.family_of_router(router)


def test_check_excuses_another_right_pick_on_ties(monkeypatch):
    """On exact ties another pick is right when it is one: here route() made to pick the two
    highest expert ids (one group, equal weights) where transformers picks others. The check
    accepts it, and refuses garbage on the same tied rows (expert 0 twice, weight 123)."""
    router, family = _all_tied_deepseek_router()
    assert R.check_router(router, family, torch.bfloat16) is None
    route = R.route
    E = router.weight.shape[0]

    def highest_ids(logits, **kwargs):
        w, ids = route(logits, **kwargs)
        return w, torch.arange(E - 1, E - 1 - ids.shape[1], -1, dtype=ids.dtype).expand_as(ids).contiguous()

    def garbage(logits, **kwargs):
        w, ids = route(logits, **kwargs)
        return torch.full_like(w, 123.0), torch.zeros_like(ids)

    monkeypatch.setattr(R, "route", highest_ids)
    hidden = torch.randn(5, HIDDEN).to(torch.bfloat16)
    _, _, ids_hf = R._original_topk(router, family.original_class(family.router_class), hidden, R.RULES[family.name])
    assert not torch.equal(ids_hf.sort(-1).values, torch.tensor([[E - 2, E - 1]] * 5))  # the excuse is needed
    assert R.check_router(router, family, torch.bfloat16) is None
    monkeypatch.setattr(R, "route", garbage)
    assert R.check_router(router, family, torch.bfloat16) == (
        "64 of 64 random tokens chose other experts than transformers' router")


def test_fusing_beside_transformers_experts_is_refused():
    """transformers' own experts read int64 ids (its eager one_hot refuses int32) and its Llama-4
    block dense scores: fuse_routers needs moekit's experts beside each router. The message said
    both, then "pass fused_routing=True to it; leave fused_routing off": one instruction now."""
    for family, reads in (("mixtral", "which read int64 ids"),
                          ("llama4", "in transformers' MoE block, which reads the router's dense scores")):
        model = tiny_model(family)
        with pytest.raises(UnsupportedModelError) as refused:
            mh.fuse_routers(model)
        said = str(refused.value)
        assert f"the experts beside it are transformers' own, {reads}" in said
        assert said.endswith("run moekit.hf.patch_model(model, fused_routing=True) instead: it puts moekit's "
                             "experts in place, then fuses the routers")
        assert "leave fused_routing off" not in said and "Llama-4" not in said
        assert not any(R.is_fused(r) for r in _routers(model))


def test_a_routers_own_forward_pinned_on_it_is_fine_a_foreign_wrapper_is_refused():
    """compressed-tensors leaves each module's own forward bound on the instance (which would hide
    the fused class's): dropped at the swap, and the fused forward runs. A wrapper of another
    kind (accelerate's offloading hook, say) would keep calling transformers' forward: refused."""
    model = mh.patch_model(tiny_model("mixtral"), backend="reference")
    first, second = _routers(model)
    first.forward = first.forward  # bound, the class's own
    second.forward = lambda hidden_states: None
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.mlp\.gate.*wrapped by a hook of its own"):
        mh.fuse_routers(model)
    del second.forward
    assert mh.fuse_routers(model) == 2 and "forward" not in vars(first)
    hidden = torch.randn(3, HIDDEN).to(torch.bfloat16)
    assert first(hidden)[2].dtype == torch.int32  # the fused forward's ids


def test_a_float32_router_in_a_bf16_model():
    """A router kept in float32 (under autocast, say) is checked with float32 hidden states."""
    model = mh.patch_model(tiny_model("qwen3_moe"), backend="reference")
    for r in _routers(model):
        r.float()
    assert mh.fuse_routers(model) == 2


def test_a_router_that_fails_to_run_is_named():
    model = mh.patch_model(tiny_model("olmoe"), backend="reference")
    router = _routers(model)[0]
    router.top_k = 99  # more than its 8 experts
    with pytest.raises(UnsupportedModelError, match=r"layers\.0\.mlp\.gate \(OlmoeTopKRouter\): running it on the "
                       r"check's random hidden states failed"):
        mh.fuse_routers(model)


@pytest.fixture(scope="module")
def fp8_mixtral(tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    from test_hf_tiny import fp8_checkpoint

    return fp8_checkpoint(tmp_path_factory, "mixtral")[0]


@pytest.mark.parametrize("how", ["patch_model", "from_pretrained"])
@pytest.mark.parametrize("family", ["mixtral", "llama4"])
def test_a_model_with_fused_routers_pickles(family, how, tmp_path, tmp_path_factory):
    """torch.save of a whole model and torch.load in a new process (where the fused router
    classes, moekit's Llama-4 block and its load-time experts classes are found by name) give the
    same output."""
    if how == "patch_model":
        model = mh.patch_model(tiny_model(family), backend="reference", fused_routing=True)
    else:
        folder = tmp_path_factory.mktemp("bf16")
        tiny_model(family).save_pretrained(folder)
        model = mh.from_pretrained(folder, backend="reference", fused_routing=True)
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens).logits
    torch.save(model, tmp_path / "model.pt")
    torch.save(tokens, tmp_path / "tokens.pt")
    child = (
        "import torch, sys\n"
        "model = torch.load(sys.argv[1], weights_only=False)\n"
        "assert all(type(m).__name__.startswith('Fused') for m in model.modules() if 'Router' in type(m).__name__)\n"
        "with torch.no_grad():\n"
        "    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])\n"
    )
    done = subprocess.run([sys.executable, "-c", child, str(tmp_path / "model.pt"), str(tmp_path / "tokens.pt"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), want)


def test_fuse_unfuse_fuse_on_a_compressed_tensors_checkpoint(fp8_mixtral, monkeypatch):
    """transformers' loading of a compressed-tensors checkpoint has compressed-tensors wrap every
    module's forward at the first forward (its offloading wrapper, which calls the forward it
    captured). Fused at load, the wrapper captures the fused forward; unfused, it must call
    transformers' again; fused again, the fused one. Each state gives its own right output and
    ids dtype (int32 fused, int64 not)."""
    from moekit.hf import routers

    model = mh.from_pretrained(fp8_mixtral, backend="reference", fused_routing=True)
    tokens = _tokens()
    calls = []
    route = routers.route

    def spy(logits, **kwargs):
        calls.append(logits.shape[0])
        return route(logits, **kwargs)

    monkeypatch.setattr(routers, "route", spy)
    with torch.no_grad():
        fused = model(tokens).logits
        assert calls, "the fused routers did not run"
        router = _routers(model)[0]
        assert "forward" in vars(router)  # compressed-tensors' wrapper, put there at the first forward
        assert mh.unfuse_routers(model) == 2
        del calls[:]
        unfused = model(tokens).logits
        assert not calls and router(torch.randn(3, HIDDEN).to(torch.bfloat16))[2].dtype == torch.int64
        assert mh.fuse_routers(model) == 2
        again = model(tokens).logits
        assert calls and router(torch.randn(3, HIDDEN).to(torch.bfloat16))[2].dtype == torch.int32
    assert torch.equal(fused, unfused) and torch.equal(again, fused)  # top-2: the same routing bitwise


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe", "llama4"])
def test_fused_routers_on_gpu(family, monkeypatch):
    """On a GPU the fused router is one launch of the routing kernel, and the model's output stays
    within the experts' own agreement: fused routing differs only in the weights' last float32
    bits and on exact ties, so the bf16 logits agree to bf16 resolution except where a token's
    tie went the other way (then within the 2e-2 the backends' model check allows)."""
    from moekit import routing

    dev = torch.device("cuda")
    model = mh.patch_model(tiny_model(family).to(dev), backend="reference")
    tokens = _tokens().to(dev)
    calls = []  # route()'s choice of path on each call: True where it took the kernel
    use_kernel = routing._use_kernel

    def spy(logits):
        calls.append(use_kernel(logits))
        return calls[-1]

    with torch.no_grad():
        want = model(tokens).logits.float()
        mh.fuse_routers(model)
        monkeypatch.setattr(routing, "_use_kernel", spy)
        got = model(tokens).logits.float()
    assert calls and all(calls), "the fused routers did not take the routing kernel"
    rel = float((got - want).norm() / want.norm())
    assert rel < 2e-2, rel
