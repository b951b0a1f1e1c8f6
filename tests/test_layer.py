"""`moekit.MoELayer`: forward against fused_moe + route, buffers / state_dict / .to(), memory
accounting, no weight copies under auto, and a backend chosen per call."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit import decisions, select, tables
from moekit.backends import cutlass, get_backend
from moekit.layer import weight_memory
from moekit.models import ModelSpec
from moekit.routing import RoutingConfig
from moekit.spec import MoEShape, get_scheme

from helpers import capture_graph, random_routing, random_weights, random_x

E, H, N = 8, 128, 128
GLM_LIKE = RoutingConfig(top_k=2, scoring="sigmoid", renormalize=True, use_correction_bias=True, routed_scaling_factor=2.5)
LLAMA4_LIKE = RoutingConfig(top_k=1, scoring="sigmoid", renormalize=False, apply_on_input=True)
SOFTMAX = RoutingConfig(top_k=2)


def spec(scheme="fp8-channel-token", routing=GLM_LIKE):
    return ModelSpec("tiny", MoEShape(E, H, N, routing.top_k), get_scheme(scheme), routing, "test")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "SHIPPED_ROOT", tmp_path / "shipped")
    monkeypatch.delenv(tables.CONFIG_DIR_ENV, raising=False)
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    monkeypatch.setattr(select, "_supports_cache", {})
    monkeypatch.setattr(decisions, "_warned", set())


@pytest.fixture
def ran(monkeypatch):
    """The backends that ran, in order (each backend's run wrapped)."""
    names = []
    for name in moekit.backend_names():
        backend = get_backend(name)

        def spy(x, weights, tw, ids, _run=backend.run, _name=name):
            names.append(_name)
            return _run(x, weights, tw, ids)

        monkeypatch.setattr(backend, "run", spy)
    return names


def inputs(M, routing=GLM_LIKE, seed=0):
    g = torch.Generator().manual_seed(seed + 11)
    return random_x(M, H, seed=seed), torch.randn(M, E, generator=g)


# ------------------------------------------------------------------------------------ forward

# Same backend, same inputs, same deterministic computation: MoELayer must equal fused_moe + route
# bit for bit (tolerance 0); any difference means the layer routed or scaled differently.
CASES = [
    ("fp8-channel-token", "reference", GLM_LIKE),
    ("fp8-channel-token", "torch", GLM_LIKE),
    ("fp8-block128", "triton", SOFTMAX),
    ("bf16", "torch", LLAMA4_LIKE),
]


@pytest.mark.parametrize("scheme,backend,routing", CASES)
@pytest.mark.parametrize("M", [0, 1, 5])
def test_forward_matches_fused_moe_and_route(scheme, backend, routing, M, device):
    layer = moekit.MoELayer.random(spec(scheme, routing), backend=backend, device=device)
    x, logits = (t.to(device) for t in inputs(M, routing))
    bias = getattr(layer, "e_score_correction_bias", None)
    tw, ids = moekit.route(logits, config=routing, correction_bias=bias)
    want = moekit.fused_moe(x, layer.weights, tw, ids, backend, apply_router_weight_on_input=routing.apply_on_input)
    got_logits = layer(x, logits)
    got_routed = layer(x, tw, ids)
    assert got_logits.shape == (M, H) and got_logits.dtype == x.dtype
    assert torch.equal(got_logits, want) and torch.equal(got_routed, want)
    if M:
        assert want.abs().sum() > 0


def test_router_weight_on_the_input_and_the_correction_bias_are_applied():
    layer = moekit.MoELayer.random(spec("bf16", LLAMA4_LIKE), backend="torch")
    x, logits = inputs(6)
    tw, ids = moekit.route(logits, config=LLAMA4_LIKE)
    on_output = moekit.fused_moe(x, layer.weights, tw, ids, "torch")
    # SiLU is not linear, so weighting the input differs from weighting the output
    assert not torch.allclose(layer(x, logits).float(), on_output.float(), rtol=1e-2, atol=1e-2)

    layer = moekit.MoELayer.random(spec("bf16", GLM_LIKE), backend="torch")
    with torch.no_grad():
        layer.e_score_correction_bias.zero_()[3] = 100.0  # expert 3 wins every token's choice
    _, ids = moekit.route(logits, config=GLM_LIKE, correction_bias=layer.e_score_correction_bias)
    assert (ids == 3).any(dim=1).all()
    tw, ids = moekit.route(logits, config=GLM_LIKE, correction_bias=layer.e_score_correction_bias)
    assert torch.equal(layer(x, logits), moekit.fused_moe(x, layer.weights, tw, ids, "torch"))


def test_leading_dimensions_and_bad_calls():
    layer = moekit.MoELayer.random(spec("bf16", SOFTMAX), backend="torch")
    x, logits = inputs(6)
    out = layer(x.view(2, 3, H), logits.view(2, 3, E))
    assert out.shape == (2, 3, H) and torch.equal(out.view(6, H), layer(x, logits))
    with pytest.raises(TypeError, match=r"\(x, router_logits\) or \(x, topk_weights, topk_ids\)"):
        layer(x)
    no_routing = moekit.MoELayer(layer.weights, backend="torch")
    with pytest.raises(ValueError, match="no RoutingConfig"):
        no_routing(x, logits)
    tw, ids = moekit.route(logits, 2)
    assert torch.equal(no_routing(x, tw, ids), layer(x, tw, ids))
    with pytest.raises(ValueError, match="hidden 4096 but the weights have 128"):
        moekit.MoELayer.from_model("mixtral-8x7b", layer.weights)
    with pytest.raises(ValueError, match="correction_bias was given"):
        moekit.MoELayer(layer.weights, SOFTMAX, correction_bias=torch.zeros(E))


def test_router_logits_must_cover_the_layers_experts_and_match_x():
    """Logits of fewer columns than experts routed to the first experts only, silently; more
    columns failed on the ids ("topk_ids must lie in [0, 8)"), which blamed the ids; leading
    dimensions of another shape with as many tokens were taken."""
    layer = moekit.MoELayer.random(spec("bf16", SOFTMAX), backend="torch")
    x, logits = inputs(6)
    for columns in (E - 1, E + 1):
        with pytest.raises(ValueError, match=rf"router_logits has {columns} columns but this layer routes over {E} experts"):
            layer(x, torch.randn(6, columns))
    with pytest.raises(ValueError, match=r"router_logits \(3, 2, 8\) does not match x \(2, 3, 128\): expected the "
                                         r"same leading dimensions, \(2, 3, 8\), or \[6, 8\]"):
        layer(x.view(2, 3, H), logits.view(3, 2, E))
    with pytest.raises(ValueError, match=r"router_logits \(5, 8\) does not match x \(6, 128\)"):
        layer(x, logits[:5])
    # one side flat with as many tokens: the same rows, taken (flat x with [B, S, E] logits ran before)
    assert torch.equal(layer(x, logits.view(2, 3, E)), layer(x, logits))
    with pytest.raises(ValueError, match="router_logits must be a tensor"):
        layer(x, torch.tensor(1.0))
    # [M, E] logits of an x with leading dimensions: as many tokens, taken
    assert torch.equal(layer(x.view(2, 3, H), logits).view(6, H), layer(x, logits))


def test_a_backend_name_is_checked_when_it_is_set():
    """MoELayer(weights, backend="nope") was taken; the error came at the first call."""
    layer = moekit.MoELayer.random(spec("bf16", SOFTMAX), backend="torch")
    with pytest.raises(ValueError, match="unknown backend 'nope'; expected one of: auto, "):
        moekit.MoELayer(layer.weights, SOFTMAX, backend="nope")
    with pytest.raises(ValueError, match="unknown backend 'tirton'"):
        layer.backend = "tirton"
    assert layer.backend == "torch"
    with pytest.raises(TypeError, match="backend must be a backend's name"):
        layer.backend = 3
    for name in (None, "auto", "reference"):
        layer.backend = name
        assert layer.backend == name


# ----------------------------------------------------------------------- buffers, state dict, .to


def test_state_dict_round_trip_and_stale_copies():
    a = moekit.MoELayer.random(spec(), seed=0, backend="torch")
    b = moekit.MoELayer.random(spec(), seed=1, backend="torch")
    assert set(a.state_dict()) == {"w13", "w2", "w13_scale", "w2_scale", "e_score_correction_bias"}
    assert a.state_dict(keep_vars=True)["w13"] is a.weights.w13  # the buffers are the weights: no copy
    x, logits = inputs(5)
    want = a(x, logits)
    assert not torch.equal(b(x, logits), want)  # b now holds a dequantized copy of its own weights
    from moekit.layer import _tensors_in

    ptrs = [t.data_ptr() for t in _tensors_in(b.weights.prepared)]
    b.load_state_dict(a.state_dict())
    assert torch.equal(b(x, logits), want)  # the copy rewritten to a's values...
    assert [t.data_ptr() for t in _tensors_in(b.weights.prepared)] == ptrs  # ...in its own memory
    c = moekit.MoELayer.random(spec(), seed=2, backend="torch")
    c.load_state_dict(a.state_dict(), assign=True)
    assert torch.equal(c(x, logits), want)


def test_load_state_dict_refuses_another_dtype():
    a = moekit.MoELayer.random(spec())
    state = {k: v.float() if k == "w13" else v for k, v in a.state_dict().items()}
    with pytest.raises(RuntimeError, match="w13 has dtype torch.float32 in the state dict but torch.float8_e4m3fn"):
        moekit.MoELayer.random(spec(), seed=1).load_state_dict(state)


@pytest.mark.parametrize("built, saved", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_load_state_dict_converts_between_bf16_and_fp16(built, saved):
    """An unquantized layer follows model.half(), so a state dict of model.half() holds fp16
    weights: loading it into a bf16-built layer was refused ("load weights of the same scheme"),
    though bf16 and fp16 are one scheme and nn.Linear converts on load. It now loads converted to
    the layer's dtype (also with assign=True); another dtype (float32) is still refused."""
    source = moekit.MoELayer.random(spec("bf16"), seed=0, backend="reference").to(saved)
    state = source.state_dict()
    x, logits = inputs(5)
    for assign in (False, True):
        b = moekit.MoELayer.random(spec("bf16"), seed=1, backend="reference").to(built)
        b.load_state_dict(state, assign=assign)
        assert b.w13.dtype == b.w2.dtype == built and b.weights.w13 is b.w13
        assert torch.equal(b.w13, state["w13"].to(built)) and torch.equal(b.w2, state["w2"].to(built))
        want = moekit.fused_moe(x.to(built), moekit.MoEWeights(b.weights.scheme, state["w13"].to(built),
                                                               state["w2"].to(built)),
                                *moekit.route(logits, config=GLM_LIKE,
                                              correction_bias=state["e_score_correction_bias"]), "reference")
        assert torch.equal(b(x.to(built), logits), want)
    wrong = {k: v.float() if k == "w13" else v for k, v in state.items()}
    with pytest.raises(RuntimeError, match=f"w13 has dtype torch.float32 in the state dict but {built}"):
        moekit.MoELayer.random(spec("bf16"), seed=1).to(built).load_state_dict(wrong)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_load_state_dict_takes_a_float_correction_bias(dtype):
    """Checkpoints hold e_score_correction_bias in bf16 too: it was refused ("load weights of the
    same scheme"); a float bias is now converted to the float32 buffer, also with assign=True."""
    a = moekit.MoELayer.random(spec(), seed=0, backend="reference")
    x, logits = inputs(5)
    state = {k: v.to(dtype) if k == "e_score_correction_bias" else v for k, v in a.state_dict().items()}
    for assign in (False, True):
        b = moekit.MoELayer.random(spec(), seed=0, backend="reference")
        b.load_state_dict(state, assign=assign)
        assert b.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(b.e_score_correction_bias, state["e_score_correction_bias"].float())
        tw, ids = moekit.route(logits, config=GLM_LIKE, correction_bias=state["e_score_correction_bias"].float())
        assert torch.equal(b(x, logits), moekit.fused_moe(x, b.weights, tw, ids, "reference"))
    state["e_score_correction_bias"] = torch.zeros(E, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"e_score_correction_bias must be a float32 \(or bf16 / fp16\) tensor, got torch.int64"):
        b.load_state_dict(state)


def test_to_dtype_keeps_fp8_weights_and_float32_scales():
    layer = moekit.MoELayer.random(spec(), backend="reference")
    x, logits = inputs(3)
    want = layer(x, logits)
    dtypes = {k: v.dtype for k, v in layer.state_dict().items()}
    assert layer.to(torch.bfloat16) is layer and layer.half() is layer
    assert {k: v.dtype for k, v in layer.state_dict().items()} == dtypes
    assert layer.w13.dtype == torch.float8_e4m3fn and layer.w13_scale.dtype == torch.float32
    assert torch.equal(layer(x, logits), want)
    layer.to("cpu")
    assert torch.equal(layer(x, logits), want)


# --------------------------------------------------------------------- memory and weight copies


def test_memory_accounting():
    layer = moekit.MoELayer.random(spec("fp8-channel-token"))
    fp8 = E * 2 * N * H + E * H * N  # one byte per FP8 weight
    scales = 4 * (E * 2 * N + E * H)  # float32 per output channel
    assert layer.memory() == {"weights": fp8 + scales, "prepared": {}, "total": fp8 + scales}
    x, logits = inputs(4)
    layer(x, logits)  # auto
    assert layer.memory()["prepared"] == {}
    layer.backend = "torch"  # named: the dequantized bf16 copy is made, and counted
    layer(x, logits)
    assert layer.memory()["prepared"] == {"torch": 2 * fp8}
    assert layer.memory()["total"] == fp8 + scales + 2 * fp8

    # cutlass keeps views of the weights (0 bytes), plus expanded scales for per-tensor scales
    channel = random_weights(E, H, N, "fp8-channel-token")
    cutlass.prepare(channel)
    assert weight_memory(channel)["prepared"] == {"cutlass": 0}
    tensor = random_weights(E, H, N, "fp8-tensor-dynamic")
    cutlass.prepare(tensor)
    assert weight_memory(tensor)["prepared"] == {"cutlass": 4 * (E * 2 * N + E * H)}


def test_auto_in_a_layer_never_copies_the_weights_unless_named(ran, monkeypatch):
    layer = moekit.MoELayer.random(spec("fp8-channel-token"))
    x, logits = inputs(3)
    tw, ids = moekit.route(logits, config=GLM_LIKE, correction_bias=layer.e_score_correction_bias)
    moekit.fused_moe(x, layer.weights, tw, ids)  # plain auto on the CPU: torch (its copy is allowed)
    layer.weights.prepared.clear()
    layer(x, logits)
    assert ran == ["torch", "reference"]  # the layer's auto passed over torch
    assert layer.memory()["prepared"] == {}
    monkeypatch.setenv(select.ENV_VAR, "torch")  # named through the environment: it runs
    layer(x, logits)
    assert ran[-1] == "torch" and layer.memory()["prepared"]["torch"] > 0
    bf16 = moekit.MoELayer.random(spec("bf16", SOFTMAX))  # unquantized: torch reads them as they are
    monkeypatch.delenv(select.ENV_VAR)
    bf16(*inputs(3))
    assert ran[-1] == "torch" and bf16.memory()["prepared"] == {}  # nothing prepared, nothing copied


def test_backend_chosen_per_call_from_a_table(tmp_path, monkeypatch, ran):
    s = spec("bf16", SOFTMAX)
    points = {"1": ("reference", {"reference": 3.0, "torch": 5.0}), "64": ("torch", {"reference": 90.0, "torch": 40.0})}
    data = {
        "format": "moekit-backend-table", "version": 1,
        "meta": {"device_name": "cpu", "num_experts": E, "hidden": H, "intermediate": N, "top_k": 2,
                 "scheme": "bf16", "dtype": "bfloat16", "routing": "uniform", "mode": "layer"},
        "batch_sizes": {m: {"us": us, "winner": w, "errors": {}} for m, (w, us) in points.items()},
    }
    tables.write_json_atomically(tmp_path / "backends" / tables.table_name(s.shape, s.scheme, "cpu"), data)
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path))
    layer = moekit.MoELayer.random(s)
    # between 1 and 64, t = (M-1)/63: reference 3 + 87t, torch 5 + 35t: reference while t < 2/52 (M <= 3)
    for M in (1, 64, 3, 40):
        layer(*inputs(M))
    assert ran == ["reference", "torch", "reference", "torch"]


@pytest.mark.gpu
def test_layer_on_the_gpu_chooses_per_call_and_captures_into_a_graph(ran):
    """GLM-4.5V-FP8 at tp 2, real size: auto per call, no weight copy, and a CUDA graph replay
    equal to the eager call (selection never synchronises the GPU)."""
    layer = moekit.MoELayer.random("glm-4.5v-fp8", tp=2, device="cuda")
    E, H = layer.weights.num_experts, layer.weights.hidden
    for M in (1, 64, 4096):
        g = torch.Generator(device="cuda").manual_seed(M)
        x = torch.randn(M, H, device="cuda", generator=g).bfloat16()
        logits = torch.randn(M, E, device="cuda", generator=g)
        tw, ids = moekit.route(logits, config=layer.routing, correction_bias=layer.e_score_correction_bias)
        want = moekit.fused_moe(x, layer.weights, tw, ids, moekit.select_backend(
            layer.weights.shape(8), layer.weights.scheme, x.device, x.dtype, M, allow_weight_copies=False).backend)
        assert torch.equal(layer(x, logits), want)
    assert "torch" not in ran and layer.memory()["prepared"].get("torch", 0) == 0
    x = torch.randn(16, H, device="cuda").bfloat16()
    tw, ids = moekit.route(torch.randn(16, E, device="cuda"), config=layer.routing, correction_bias=layer.e_score_correction_bias)
    eager = layer(x, tw, ids)
    graph, out = capture_graph(lambda: layer(x, tw, ids), warmup=1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_the_correction_bias_is_checked_when_the_layer_is_made():
    """A bias of the wrong length failed only at the first forward; an integer one was converted
    quietly (route() and load_state_dict refuse it)."""
    w = moekit.MoELayer.random(spec(), seed=0).weights
    rule = spec().routing
    for bad, what in ((torch.zeros(w.num_experts + 1), "of shape"), (torch.zeros(w.num_experts, dtype=torch.int64),
                                                                      "torch.int64")):
        with pytest.raises(ValueError, match=f"correction_bias must be a float tensor of shape .*{what}"):
            moekit.MoELayer(w, rule, correction_bias=bad)


def test_a_routing_that_cannot_run_on_the_layers_experts_is_refused_when_the_layer_is_made():
    """3 groups of 8 experts, or top-4 of the 2 experts of one kept group, were accepted and failed
    at the first forward: the layer runs route()'s own check against its E when it is made."""
    w = moekit.MoELayer.random(spec(routing=SOFTMAX), seed=0).weights
    for rule, match in (
        (RoutingConfig(top_k=2, num_groups=3, topk_groups=1), r"num_groups must be a positive integer dividing E=8, got 3"),
        (RoutingConfig(top_k=4, num_groups=4, topk_groups=1),
         r"top_k=4 exceeds the experts in the kept groups: topk_groups=1 \* \(E/num_groups=2\) = 2"),
    ):
        with pytest.raises(ValueError, match=r"routing does not fit this layer's 8 experts: " + match):
            moekit.MoELayer(w, rule)
    layer = moekit.MoELayer(w, RoutingConfig(top_k=4, scoring="sigmoid", num_groups=4, topk_groups=2))
    x, logits = inputs(3)
    assert layer(x, logits).shape == (3, H)
    assert sum(map(len, layer.warmup(batch_sizes=[1, 2], dtype="bf16").sizes.values())) == 2  # a dtype by name


def test_moving_a_layer_keeps_nothing_of_its_old_weights():
    """Carrying derived state over load_state_dict kept the whole old MoEWeights alive after
    .to(another device) as well: moving a layer off a GPU freed nothing until it ran again."""
    import gc
    import weakref

    layer = moekit.MoELayer.random(spec(), seed=0, backend="torch")
    x, logits = inputs(3)
    layer(x, logits)
    old = weakref.ref(layer.weights.w13)
    layer.to("meta")
    gc.collect()
    assert old() is None and "_older_weights" not in layer.__dict__


@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-tensor-static"])
def test_a_layer_allocated_but_not_loaded_prints_and_checks_its_scales_at_the_first_call(scheme):
    """A layer made on the meta device and given memory with to_empty holds whatever memory held
    until load_state_dict: printing it, or asking its memory, read `layer.weights`, and the scale
    check made at construction failed there (a review found repr failing 19 times in 20). The
    check now waits for the layer's first call, which refuses a NaN scale by name; after a load
    the layer runs."""
    loaded = moekit.MoELayer.random(spec(scheme), seed=1, backend="torch")
    layer = moekit.MoELayer.random(spec(scheme), seed=2, backend="torch").to("meta").to_empty(device="cpu")
    for name, t in layer.named_buffers():  # what unloaded memory may hold, made certain
        if name.endswith("_scale"):
            t.fill_({"w2_scale": float("nan"), "a13_scale": -1.0}.get(name, 1.0))
    assert "E=8" in repr(layer) and layer.memory()
    assert layer.weights.scale_values_pending
    x, logits = inputs(3)
    with pytest.raises(ValueError, match=r"MoEWeights.w2_scale has \d+ value\(s\) that are NaN, infinite or negative"):
        layer(x, logits)
    tw, ids = random_routing(3, E, 2)
    with pytest.raises(ValueError, match="MoEWeights.w2_scale"):  # the layer's weights called directly: checked too
        moekit.fused_moe(x, layer.weights, tw, ids, backend="torch")
    if scheme == "fp8-tensor-static":
        layer.w2_scale.fill_(1.0)
        with pytest.raises(ValueError, match="MoEWeights.a13_scale must be positive and finite, got -1.0"):
            layer(x, logits)
    layer.load_state_dict(loaded.state_dict())
    torch.testing.assert_close(layer(x, logits), loaded(x, logits), rtol=0, atol=0)
    assert not layer.weights.scale_values_pending


def test_routing_results_of_another_top_k_than_the_layers_are_refused():
    """A layer routing top-2 given top-3 ids (routed by another rule) ran them silently."""
    layer = moekit.MoELayer.random(spec(routing=SOFTMAX), seed=0)
    x, logits = inputs(5)
    k = layer.routing.top_k
    with pytest.raises(ValueError, match=rf"topk_ids has {k + 1} experts per token, but this MoELayer's "
                                         rf"RoutingConfig has top_k={k}"):
        layer(x, *moekit.route(logits, k + 1))
    # the layer's own rule, given as routing results, is the same call as with the logits
    assert torch.equal(layer(x, *moekit.route(logits, config=layer.routing)), layer(x, logits))
    # without a RoutingConfig the layer takes any top-k
    bare = moekit.MoELayer(layer.weights)
    assert bare(x, *moekit.route(logits, k + 1)).shape == x.shape


def test_routing_results_must_have_x_leading_dimensions():
    """Routing results [S, B, K] of a [B, S, H] x were flattened and run: every token got another
    token's experts, silently (the same mistake with router logits was refused). They now get
    the logits' check."""
    layer = moekit.MoELayer.random(spec("bf16", SOFTMAX), backend="torch")
    x, logits = inputs(6)
    tw, ids = moekit.route(logits, config=SOFTMAX)
    k = SOFTMAX.top_k

    def seq_first(t):  # [B, S, K] rows as [S, B, K]: as many tokens, another order
        return t.view(2, 3, k).transpose(0, 1).contiguous()

    with pytest.raises(ValueError, match=rf"topk_weights \(3, 2, {k}\) does not match x \(2, 3, {H}\): expected the "
                                         rf"same leading dimensions, \(2, 3, {k}\), or \[6, {k}\]"):
        layer(x.view(2, 3, H), seq_first(tw), seq_first(ids))
    with pytest.raises(ValueError, match=rf"topk_ids \(3, 2, {k}\) does not match x \(2, 3, {H}\)"):
        layer(x.view(2, 3, H), tw.view(2, 3, k), seq_first(ids))
    with pytest.raises(ValueError, match=rf"topk_weights \(5, {k}\) does not match x \(6, {H}\)"):
        layer(x, tw[:5], ids[:5])
    # taken: the same leading dimensions, or as many tokens with either side flat (as the logits)
    want = layer(x, tw, ids)
    assert torch.equal(layer(x.view(2, 3, H), tw.view(2, 3, k), ids.view(2, 3, k)).view(6, H), want)
    assert torch.equal(layer(x.view(2, 3, H), tw, ids).view(6, H), want)
    assert torch.equal(layer(x, tw.view(2, 3, k), ids.view(2, 3, k)), want)


# ------------------------------------------------------------ assigned weights and dtype conversion


def test_a_tensor_assigned_to_the_layers_weights_becomes_its_buffer():
    """A valid tensor assigned to the MoEWeights a layer runs (`w.w13 = new` for the weights it was
    made with, or `layer.weights.w13 = new`) split the layer: forward ran the new tensor,
    state_dict() saved the old buffer, and a no-op .to("cpu") went back to the old weights."""
    w = random_weights(E, H, N, "fp8-channel-token", seed=0)
    new = random_weights(E, H, N, "fp8-channel-token", seed=1)
    layer = moekit.MoELayer(w, SOFTMAX, backend="torch")  # named: keeps a dequantized copy to rebuild
    twin = moekit.MoELayer(w, SOFTMAX, backend="torch")  # a second layer over the same weights
    x, logits = inputs(5)
    old = layer(x, logits)
    want = moekit.MoELayer(new, SOFTMAX, backend="torch")(x, logits)
    for name in ("w13", "w13_scale"):  # through the weights the layer was made with
        setattr(w, name, getattr(new, name).clone())
    for name in ("w2", "w2_scale"):  # through layer.weights
        setattr(layer.weights, name, getattr(new, name).clone())
    for module in (layer, twin):
        state = module.state_dict(keep_vars=True)
        assert all(state[name] is t for name, t in w.tensors().items())
        assert torch.equal(module(x, logits), want)
        module.to("cpu")  # rebuilds its MoEWeights over the buffers: the new ones
        assert torch.equal(module(x, logits), want)
    # a refused assignment changes neither the weights nor the layer
    buffers = dict(layer.named_buffers())
    with pytest.raises(ValueError, match="MoEWeights.w13_scale"):
        layer.weights.w13_scale = torch.ones(E, 3)
    assert dict(layer.named_buffers()) == buffers
    # weights a layer no longer runs (its buffers since loaded with assign=True) leave it alone
    stale = layer.weights
    layer.load_state_dict(random_weights(E, H, N, "fp8-channel-token", seed=0).tensors(), assign=True)
    assert torch.equal(layer(x, logits), old)
    stale.w13 = new.w13.clone()
    assert layer.w13 is not stale.w13 and torch.equal(layer(x, logits), old)


def test_a_copied_layer_follows_its_own_weights():
    """deepcopy and pickling (torch.save) copy a layer with its MoEWeights: the copy's weights,
    assigned to, change the copy's buffers, never the original's."""
    import copy
    import io

    layer = moekit.MoELayer.random(spec("bf16", SOFTMAX), seed=0, backend="torch")
    new = moekit.MoELayer.random(spec("bf16", SOFTMAX), seed=1, backend="torch")
    x, logits = inputs(4)
    want, old = new(x, logits), layer(x, logits)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    for twin in (copy.deepcopy(layer), torch.load(buf, weights_only=False)):
        twin.weights.w13, twin.weights.w2 = new.w13.clone(), new.w2.clone()
        assert twin.state_dict(keep_vars=True)["w13"] is twin.weights.w13
        assert torch.equal(twin(x, logits), want)
        assert torch.equal(layer(x, logits), old)


@pytest.mark.parametrize("convert", ["half", "to_float16"])
def test_unquantized_weights_follow_a_model_to_fp16_and_back(convert):
    """A bf16 layer ignored model.half() / .to(torch.float16) (every dtype was kept, as FP8 weights
    must be), then refused the model's fp16 activations. Its unquantized weights now follow a
    conversion to bf16 or fp16; the correction bias stays float32, and float32 / float64 leave
    the weights as they are (float32 x runs on them)."""
    layer = moekit.MoELayer.random(spec("bf16", GLM_LIKE), backend="torch")  # named: may copy the weights
    model = torch.nn.Sequential(torch.nn.Linear(H, H)).to(torch.bfloat16)
    model.add_module("moe", layer)
    x, logits = inputs(5)
    layer(x.float(), logits)  # the torch backend's float32 copy of the bf16 weights
    before = layer.weights
    assert "torch" in before.prepared
    model.half() if convert == "half" else model.to(torch.float16)
    assert model[0].weight.dtype == layer.w13.dtype == layer.w2.dtype == torch.float16
    assert layer.e_score_correction_bias.dtype == torch.float32
    w = layer.weights  # rebuilt over the new buffers, nothing derived from the bf16 ones kept
    assert w is not before and w.w13 is layer.w13 and w.prepared == {}
    # the same unquantized scheme, asked for in fp16: float32 weights quantized to it become fp16
    assert w.scheme == get_scheme("bf16") and w.scheme.cast_dtype == "fp16"
    assert moekit.quantize_weights(w.w13.float(), w.w2.float(), w.scheme).w13.dtype == torch.float16
    tw, ids = moekit.route(logits, config=GLM_LIKE, correction_bias=layer.e_score_correction_bias)
    fresh = moekit.MoEWeights("fp16", layer.w13.clone(), layer.w2.clone())
    for dtype in (torch.float16, torch.float32):
        assert torch.equal(layer(x.to(dtype), logits), moekit.fused_moe(x.to(dtype), fresh, tw, ids, "torch"))
    for keeps in (torch.nn.Module.float, torch.nn.Module.double):
        keeps(layer)
        assert layer.w13.dtype == torch.float16 and layer.e_score_correction_bias.dtype == torch.float32
    layer.bfloat16()
    assert layer.w13.dtype == layer.w2.dtype == torch.bfloat16 and layer.weights.scheme.cast_dtype == "bf16"
    assert layer(x, logits).dtype == torch.bfloat16
