"""torch.compile: moekit's calls are custom ops (moekit.custom_ops), so a compiled model traces
through them with fullgraph=True and its output is bitwise the eager output (the ops run the
eager code). Most tests compile with backend="aot_eager" (Dynamo and AOTAutograd, no code
generation: fast, and no C++ compiler needed); one runs inductor where a compiler exists."""

from __future__ import annotations

import copy
import gc
import pickle
import shutil
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

import moekit
from moekit import custom_ops, handles
from moekit.routing import RoutingConfig

from helpers import random_routing, random_weights, random_x

E, H, N, K = 5, 144, 128, 2  # odd E; H not a multiple of the 128-wide blocks (of 16, as triton asks)

# (scheme, backend) pairs: every backend that runs on the CPU, the triton one interpreted
CASES = [("fp8-channel-token", "reference"), ("bf16", "torch"), ("fp8-block128", "triton")]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(fn, backend="aot_eager"):
    return torch.compile(fn, backend=backend, fullgraph=True)


def _skip_unless_runs(backend, device):
    if backend == "triton" and device.type == "cpu" and not moekit.env.interpreting():
        pytest.skip("the triton backend on the CPU needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("scheme, backend", CASES)
def test_compiled_layer_is_bitwise_eager(scheme, backend, device):
    """fullgraph compile of a MoELayer routed from logits, at M = 0, 1 and odd sizes (the sizes
    change between calls, so the graph is recompiled with a dynamic M on the way)."""
    _skip_unless_runs(backend, device)
    weights = random_weights(E, H, N, scheme, device=device)
    layer = moekit.MoELayer(weights, RoutingConfig(top_k=K), backend)
    compiled = _compiled(layer)
    for M in (7, 1, 0, 33):
        x = random_x(M, H, device=device, seed=M)
        logits = torch.randn(M, E, generator=torch.Generator().manual_seed(M)).to(device)
        want = layer(x, logits)
        got = compiled(x, logits)
        assert got.shape == (M, H) and got.dtype == x.dtype
        assert torch.equal(got, want), (M, (got.float() - want.float()).abs().max())


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_changing_sizes_settle_on_one_dynamic_graph():
    """The traced code reads no size (the op's fake gives x's shape): a new M or sequence length
    costs torch's usual recompiles and no more. Without dynamic=, the first call is traced with
    static sizes and the first size change with dynamic ones, which every later size reuses
    (M >= 2: torch specializes sizes 0 and 1); with dynamic=True one graph serves them all."""
    layer = moekit.MoELayer(random_weights(E, H, N, "bf16"), RoutingConfig(top_k=K), "torch")
    torch._dynamo.utils.counters.clear()
    compiled = _compiled(layer)
    for call, M in enumerate((5, 6, 9, 2, 17)):
        x, logits = random_x(M, H, seed=M), torch.randn(M, E)
        assert torch.equal(compiled(x, logits), layer(x, logits))
        assert _graphs() == min(call + 1, 2), (M, _graphs())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for B, S in ((2, 3), (2, 7), (4, 5)):  # [B, S, H]: both leading sizes change
        x, logits = random_x(B * S, H, seed=S).view(B, S, H), torch.randn(B, S, E)
        assert torch.equal(compiled(x, logits), layer(x, logits))
    assert _graphs() == 1


def test_backend_changed_after_compiling_is_honoured(monkeypatch):
    """The op runs the layer's eager forward, which reads layer.backend and MOEKIT_BACKEND when it
    runs: a compiled layer follows a change of either, with no recompile (nothing in the graph
    depends on them). FP8 weights tell the backends apart: `reference` quantizes the
    activations, `torch` does not."""
    monkeypatch.delenv("MOEKIT_BACKEND", raising=False)
    layer = moekit.MoELayer(random_weights(E, H, N, "fp8-channel-token"), RoutingConfig(top_k=K), "reference")
    x, logits = random_x(8, H), torch.randn(8, E)
    torch._dynamo.utils.counters.clear()
    compiled = _compiled(layer)
    on_reference = compiled(x, logits)
    assert torch.equal(on_reference, layer(x, logits))
    layer.backend = "torch"
    on_torch = compiled(x, logits)
    assert torch.equal(on_torch, layer(x, logits)) and not torch.equal(on_torch, on_reference)
    layer.backend = "auto"  # MOEKIT_BACKEND decides before auto does
    for name, want in (("torch", on_torch), ("reference", on_reference)):
        monkeypatch.setenv("MOEKIT_BACKEND", name)
        assert torch.equal(compiled(x, logits), want), name
    assert _graphs() == 1


def test_compiled_function_with_fused_moe_and_other_ops(device):
    """moekit.fused_moe called inside a compiled function, between ops the compiler keeps: the
    routing from (topk_weights, topk_ids), a residual added after, 3-D x through a MoELayer."""
    weights = random_weights(E, H, N, "fp8-tensor-dynamic", device=device)
    layer = moekit.MoELayer(weights, backend="reference")

    def block(x, topk_weights, topk_ids):
        a = moekit.fused_moe(x, weights, topk_weights, topk_ids, "reference")
        b = layer(x[None], topk_weights[None], topk_ids[None])[0]
        return x + a, b

    compiled = _compiled(block)
    for M in (9, 4):
        x = random_x(M, H, device=device, seed=M)
        tw, ids = random_routing(M, E, K, device=device, seed=M, experts=[0, 2, 3])  # 1 and 4 idle
        for got, want in zip(compiled(x, tw, ids), block(x, tw, ids)):
            assert torch.equal(got, want)



ROUTINGS = [
    RoutingConfig(top_k=K),  # softmax, renormalized (Mixtral, Qwen)
    RoutingConfig(top_k=K, renormalize=False),  # OLMoE
    RoutingConfig(top_k=K, scoring="sigmoid", num_groups=4, topk_groups=2, use_correction_bias=True,
                  routed_scaling_factor=2.5),  # DeepSeek-V3's rule
]
E_ROUTED = 8  # grouped routing scores a group by its 2 best experts: 4 groups of 2


@pytest.mark.parametrize("config", ROUTINGS, ids=["softmax", "softmax-raw", "grouped-sigmoid-bias"])
def test_route_compiles_with_its_checks_in_the_graph(config, device):
    """moekit.route traced with its value checks as assertions inside the graph (a host check
    reads a value, which a graph cannot; fullgraph refused it): the routing is bitwise eager's,
    a NaN logit still raises when the compiled graph runs (on the CPU; on a GPU a device-side
    assertion), and route + fused_moe compile into one graph."""
    bias = (0.1 * torch.randn(E_ROUTED, generator=torch.Generator().manual_seed(3))).to(device)
    bias = bias if config.use_correction_bias else None
    weights = random_weights(E_ROUTED, H, N, "fp8-channel-token", device=device)

    def block(x, logits):
        tw, ids = moekit.route(logits, config=config, correction_bias=bias)
        return tw, ids, moekit.fused_moe(x, weights, tw, ids, "reference")

    compiled = _compiled(block)
    for M in (6, 13):
        x = random_x(M, H, device=device, seed=M)
        logits = torch.randn(M, E_ROUTED, generator=torch.Generator().manual_seed(M)).to(device)
        for got, want in zip(compiled(x, logits), block(x, logits)):
            assert torch.equal(got, want)
    if device.type == "cpu":  # on a GPU the assertion would end the process's CUDA context
        logits[2, 1] = float("nan")
        with pytest.raises(RuntimeError, match="router_logits has NaN or inf"):
            compiled(x, logits)

@pytest.mark.parametrize("argument", ["renormalize", "top_k", "apply_router_weight_on_input"])
def test_a_numpy_flag_or_count_inside_fullgraph_names_the_argument(argument):
    """Dynamo traces a NumPy scalar (np.bool_ / np.int64, taken as its value in eager code) as an
    array: the checks' repr() of it stopped fullgraph tracing with dynamo's "repr() on tensor",
    moekit's argument unnamed. The refusal now names it and says to convert it beforehand; the same
    value converted compiles and runs as eager."""
    import numpy as np

    weights = random_weights(E, H, N, "fp8-channel-token")
    x = random_x(6, H)
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(1))

    def block(value):
        given = {argument: value}
        top_k = given.pop("top_k", 1)  # top-1: the router weight may multiply the input
        on_input = given.pop("apply_router_weight_on_input", False)
        tw, ids = moekit.route(logits, top_k, **given)
        return moekit.fused_moe(x, weights, tw, ids, "reference", apply_router_weight_on_input=on_input)

    numpy_value = np.int64(1) if argument == "top_k" else np.bool_(argument != "renormalize")
    with pytest.raises(Exception, match=rf"{argument}: a NumPy scalar inside torch\.compile, which traces it as an "
                                        rf"array, not a constant; convert it to a Python (bool|int) outside"):
        _compiled(lambda: block(numpy_value))()
    torch._dynamo.reset()
    python_value = numpy_value.item()
    assert torch.equal(_compiled(lambda: block(python_value))(), block(numpy_value))


class _Block(torch.nn.Module):
    """A decoder block's MoE half, as a model repeats it: what regional compilation compiles once."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x, logits):
        return x + self.moe(x, logits)


@pytest.mark.parametrize("unspec_ints", [False, True])
def test_regional_compilation_of_many_layers(unspec_ints, device):
    """One block class compiled for ten layers (module.compile(), as regional compilation does):
    every layer's output is bitwise its eager output. By default each layer is its own graph
    (ten, over the recompile limit of 8, so the limit is raised here); with
    allow_unspec_int_on_nn_module the layers' handles are a graph input, and one graph (after the
    recompile that finds the handle varying) serves all."""
    layers = 10
    blocks = [_Block(moekit.MoELayer(random_weights(E, H, N, "bf16", device=device, seed=i), RoutingConfig(top_k=K), "torch"))
              for i in range(layers)]
    counter = CompileCounter()
    x = random_x(6, H, device=device)
    logits = torch.randn(6, E).to(device)
    with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=unspec_ints, recompile_limit=16):
        for block in blocks:
            block.compile(backend=counter, fullgraph=True)
        outputs = [block(x, logits) for block in blocks]
    for block, got in zip(blocks, outputs):
        assert torch.equal(got, block.forward(x, logits))
    assert all(not torch.equal(a, b) for i, a in enumerate(outputs) for b in outputs[i + 1:])  # each its own weights
    assert counter.frame_count == (2 if unspec_ints else layers)


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle", "data_parallel_replica"])
def test_copied_module_takes_its_own_handle(how, device):
    """Every kind of copy of a moekit module (of a layer already compiled, too) gets a handle of its
    own at once, not its original's (it is the name compiled graphs use for it): a compiled copy
    runs its own weights."""
    layer = moekit.MoELayer(random_weights(E, H, N, "bf16", device=device), RoutingConfig(top_k=K), "torch")
    x = random_x(6, H, device=device)
    logits = torch.randn(6, E).to(device)
    _compiled(layer)(x, logits)
    twin = {
        "copy": copy.copy,
        "deepcopy": copy.deepcopy,
        "pickle": lambda m: pickle.loads(pickle.dumps(m)),
        "data_parallel_replica": lambda m: m._replicate_for_data_parallel(),  # what nn.DataParallel makes
    }[how](layer)
    assert layer._moekit_handle == id(layer) and twin._moekit_handle == id(twin)
    assert handles.lookup(twin._moekit_handle) is twin and handles.lookup(layer._moekit_handle) is layer
    if how == "copy":
        twin._buffers = dict(twin._buffers)  # a shallow copy shares the buffer dict itself: give it its own
    twin.w2 = twin.w2 * 2  # the copy's experts now give twice the output (a buffer of its own)
    got = _compiled(twin)(x, logits)
    assert torch.equal(got, twin(x, logits)) and not torch.equal(got, layer(x, logits))


def test_deleted_layer_leaves_nothing_registered(device):
    layer = moekit.MoELayer(random_weights(E, H, N, "bf16", device=device), RoutingConfig(top_k=K), "torch")
    compiled = _compiled(layer)
    compiled(random_x(3, H, device=device), torch.randn(3, E).to(device))
    handle = id(layer)
    assert handles._OBJECTS.get(handle) is layer
    del layer, compiled
    torch._dynamo.reset()
    gc.collect()
    assert handle not in handles._OBJECTS
    with pytest.raises(RuntimeError, match="no longer exists"):
        handles.lookup(handle)


def test_weights_built_inside_the_compiled_function_are_refused():
    """A MoEWeights made while the compiler traces is no real object the op could find again:
    under fullgraph a clear error instead of a shell without tensors; without fullgraph the graph
    breaks there and the call runs eagerly (as before moekit had custom ops)."""
    w = random_weights(E, H, N, "fp8-channel-token")
    x = random_x(4, H)
    tw, ids = random_routing(4, E, K)

    def inner(x, w13, w2, s13, s2):
        weights = moekit.MoEWeights.from_fp8("fp8-channel-token", w13, w2, s13, s2)
        return moekit.fused_moe(x, weights, tw, ids, "reference")

    args = (x, w.w13, w.w2, w.w13_scale, w.w2_scale)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="MoEWeights made outside the compiled function"):
        _compiled(inner)(*args)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(inner, backend="aot_eager")(*args), inner(*args))


def test_layer_weights_rebuilt_inside_the_compiled_function_are_refused_by_name():
    """MoELayer.weights builds its MoEWeights anew on the first read after load_state_dict (or
    .to()): read inside a compiled function, that is a MoEWeights made while the compiler traces.
    The error says so and names the way out (call the layer itself), not only the rule."""
    layer = moekit.MoELayer(random_weights(E, H, N, "bf16"), RoutingConfig(top_k=K), "torch")
    x = random_x(4, H)
    tw, ids = random_routing(4, E, K)
    compiled = _compiled(lambda x: moekit.fused_moe(x, layer.weights, tw, ids, "torch"))
    assert torch.equal(compiled(x), moekit.fused_moe(x, layer.weights, tw, ids, "torch"))  # weights built
    layer.load_state_dict(layer.state_dict())  # the layer's next read of .weights builds them again
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"MoELayer\.weights .* call the layer itself"):
        compiled(x)
    assert torch.equal(_compiled(layer)(x, tw, ids), layer(x, tw, ids))  # the way the message names


def test_gradients_never_flow_and_eager_says_so():
    """Inference only: eager calls run under no_grad (a warning when an input requires grad),
    compiled calls detach their inputs; neither output carries a gradient."""
    weights = random_weights(E, H, N, "bf16")
    x = random_x(5, H).requires_grad_()
    tw, ids = random_routing(5, E, K)
    with pytest.warns(UserWarning, match="inference only"):
        eager = moekit.fused_moe(x, weights, tw, ids, "torch")
    assert not eager.requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # under no_grad there is nothing to warn about
        with torch.no_grad():
            moekit.fused_moe(x, weights, tw, ids, "torch")
    compiled = _compiled(lambda x: moekit.fused_moe(x, weights, tw, ids, "torch"))(x)
    assert not compiled.requires_grad and torch.equal(compiled, eager)


def test_a_trainable_router_is_warned_about_too():
    """Routing weights from a router that requires grad (experts frozen): the torch backend's
    ops would otherwise carry the router's gradient on some paths and not others; moekit drops
    it on every path, and says so."""
    weights = random_weights(E, H, N, "bf16")
    x = random_x(5, H)
    tw, ids = random_routing(5, E, K)
    with pytest.warns(UserWarning, match="inference only"):
        out = moekit.fused_moe(x, weights, tw.clone().requires_grad_(), ids, "torch")
    assert not out.requires_grad and torch.equal(out, moekit.fused_moe(x, weights, tw, ids, "torch"))


def test_quantizing_parameters_keeps_no_autograd_graph():
    """quantize_weights on nn.Parameters (a transformers model's experts) with grad on: the FP8
    results must not hold an autograd graph (it kept float32 copies of the layer alive, and made
    every later call warn as if an input required grad)."""
    g = torch.Generator().manual_seed(0)
    w13 = torch.nn.Parameter(torch.randn(E, 2 * N, H, generator=g).bfloat16())
    w2 = torch.nn.Parameter(torch.randn(E, H, N, generator=g).bfloat16())
    for scheme in ("fp8-tensor-dynamic", "fp8-channel-token", "fp8-block128"):
        q = moekit.quantize_weights(w13, w2, scheme)
        assert not any(t.requires_grad for t in q.tensors().values()), scheme
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            moekit.fused_moe(random_x(3, H), q, *random_routing(3, E, K), "reference")


def test_weights_are_static_inputs_of_the_graph():
    """A MoEWeights read by a compiled function is marked a static input (as module buffers are):
    under mode="reduce-overhead" torch's CUDA graphs copy every other input into the graph's
    memory at each replay, a whole layer here."""
    weights = random_weights(E, H, N, "fp8-channel-token")
    tw, ids = random_routing(4, E, K)
    seen = {}

    def record(gm, example_inputs):
        for node, t in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
            seen[node.name] = getattr(t, "_dynamo_static_input_type", None)
        return gm.forward

    torch.compile(lambda x: moekit.fused_moe(x, weights, tw, ids, "reference"), backend=record, fullgraph=True)(
        random_x(4, H))
    weight_inputs = {k: v for k, v in seen.items() if "w13" in k or "w2" in k}
    assert len(weight_inputs) == 4 and set(weight_inputs.values()) == {"unguarded"}, seen
    assert seen[next(k for k in seen if k.startswith("l_x"))] is None  # x is not


def test_ops_pass_torch_library_opcheck():
    """torch's own checks of a custom op: schema, fake (meta) implementation against the real
    one, and tracing through AOTAutograd with dynamic shapes. The schema check multiplies
    inputs, which torch has no CPU kernel for in FP8: it runs on bf16 weights, the other checks
    on both."""
    x = random_x(6, H)
    tw, ids = random_routing(6, E, K)
    logits = torch.randn(6, E)
    for scheme, checks in (("bf16", None), ("fp8-block128", ("test_faketensor", "test_aot_dispatch_dynamic"))):
        kw = {} if checks is None else {"test_utils": checks}
        weights = random_weights(E, H, N, scheme)
        tensors = list(weights.tensors().values())
        args = (x, tw, ids, tensors, custom_ops.handle_of(weights), "reference", False, True)
        torch.library.opcheck(torch.ops.moekit.fused_moe, args, **kw)
        layer = moekit.MoELayer(weights, RoutingConfig(top_k=K), "reference")
        args = (x, [logits], list(layer.buffers()), custom_ops.handle_of(layer))
        torch.library.opcheck(torch.ops.moekit.forward, args, **kw)


def _permuted(t: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """t [B*S, D] as a [B, S, D] view of a [S, B, D] tensor (x.transpose(0, 1) of a sequence-
    first model): 3-D, not contiguous, its strides a permutation of contiguous ones."""
    return t.reshape(S, B, t.shape[-1]).transpose(0, 1)


def test_ops_outputs_are_laid_out_as_their_fakes_say():
    """The fake implementations say what the compiler may assume of an op's output, strides
    included (inductor indexes the output by them and checks them, assert_size_stride): a
    permuted [B, S, H] x still gets a contiguous output, as the eager code returns it (a fake of
    torch.empty_like(x) would claim x's permuted strides), and so does a 2-D x that is a slice."""
    weights = random_weights(E, H, N, "bf16")
    layer = moekit.MoELayer(weights, RoutingConfig(top_k=K), "torch")
    x = _permuted(random_x(12, H), 3, 4)
    logits = _permuted(torch.randn(12, E), 3, 4)
    assert not x.is_contiguous() and layer(x, logits).is_contiguous()  # what the eager code returns
    args = (x, [logits], list(layer.buffers()), custom_ops.handle_of(layer))
    torch.library.opcheck(torch.ops.moekit.forward, args, test_utils="test_faketensor")
    wide = random_x(6, 2 * H)[:, :H]  # rows of 2H elements: a 2-D x that is not contiguous
    tw, ids = random_routing(6, E, K)
    args = (wide, tw, ids, list(weights.tensors().values()), custom_ops.handle_of(weights), "torch", False, True)
    torch.library.opcheck(torch.ops.moekit.fused_moe, args, test_utils="test_faketensor")


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_inductor_keeps_the_op_bitwise():
    """With code generation (inductor), the ops still run moekit's eager code on the inputs the
    compiled graph computes: the layer's output is bitwise the eager layer's, also for a permuted
    [B, S, H] x (whose output inductor reads by the fake's strides)."""
    weights = random_weights(E, H, N, "fp8-channel-token")
    layer = moekit.MoELayer(weights, RoutingConfig(top_k=K, scoring="sigmoid"), "reference")
    compiled = torch.compile(layer, fullgraph=True)
    for M in (3, 11):
        x = random_x(M, H, seed=M)
        logits = torch.randn(M, E)
        assert torch.equal(compiled(x, logits), layer(x, logits))
    x, logits = _permuted(random_x(12, H), 3, 4), _permuted(torch.randn(12, E), 3, 4)
    assert torch.equal(compiled(x, logits), layer(x, logits))


# ----------------------------------------------------------------------------- transformers

@pytest.mark.parametrize("way", ["patch_model", "experts_implementation"])
def test_compiled_transformers_model_is_bitwise_eager(way):
    """A whole tiny transformers model compiled with fullgraph=True (what generate() does with
    a static cache), its experts run by moekit either way in: the logits are bitwise eager's."""
    pytest.importorskip("transformers", minversion="5.0")
    import moekit.hf as mh
    from test_hf_tiny import tiny_model

    model = tiny_model("qwen3_moe").eval()
    if way == "patch_model":
        mh.patch_model(model, scheme="fp8-channel-token", backend="reference")
    else:
        model.set_experts_implementation("moekit")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        got = _compiled(model)(ids).logits
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------------- the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_compiled_layer_with_cuda_graphs(mode):
    """inductor on the GPU, and with mode="reduce-overhead" (torch's CUDA graphs replay the
    moekit op): the triton backend at DeepSeek-V3's TP8 shape, bitwise eager, with fresh routing
    on every call (the graph reads the new routing, not the captured one)."""
    from moekit.inputs import make_weights
    from moekit.models import get_model

    spec = get_model("deepseek-v3", tp=8)
    dev = torch.device("cuda")
    layer = moekit.MoELayer(make_weights(spec.shape, spec.scheme, dev, seed=0), spec.routing, "triton",
                            correction_bias=torch.randn(spec.shape.num_experts, device=dev) * 0.1)
    compiled = torch.compile(layer, fullgraph=True, mode=mode)
    for call in range(4):
        x = torch.randn(64, spec.shape.hidden, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(64, spec.shape.num_experts, device=dev)
        got = compiled(x, logits).clone()
        assert torch.equal(got, layer(x, logits)), call


@pytest.mark.gpu
def test_gpu_fused_moe_of_a_closure_weights_under_cuda_graphs():
    """moekit.fused_moe with a MoEWeights from the enclosing scope (not a module's buffers) under
    mode="reduce-overhead": bitwise eager with fresh routing each call, and the weights are
    static inputs, so torch's CUDA graphs keep no copy of them (the memory the compiled calls add
    stays far below the layer's weights)."""
    from moekit.inputs import make_weights
    from moekit.models import get_model

    spec = get_model("glm-4.5v-fp8", tp=2)
    dev = torch.device("cuda")
    weights = make_weights(spec.shape, spec.scheme, dev, seed=0)
    compiled = torch.compile(lambda x, tw, ids: moekit.fused_moe(x, weights, tw, ids, "triton"),
                             fullgraph=True, mode="reduce-overhead")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    for call in range(4):
        x = torch.randn(16, spec.shape.hidden, device=dev, dtype=torch.bfloat16)
        tw, ids = moekit.route(torch.randn(16, spec.shape.num_experts, device=dev), spec.shape.top_k)
        got = compiled(x, tw, ids).clone()
        assert torch.equal(got, moekit.fused_moe(x, weights, tw, ids, "triton")), call
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(dev) - before < weights.nbytes // 2


@pytest.mark.gpu
def test_gpu_regional_compilation_under_cuda_graphs():
    """Regional compilation with allow_unspec_int_on_nn_module on the GPU, mode="reduce-overhead":
    one graph for three Qwen3-30B-A3B-shaped triton layers, each replay bitwise eager with fresh
    routing (torch's CUDA graphs record one graph per handle value: each layer its own)."""
    from moekit.inputs import make_weights
    from moekit.models import get_model

    spec = get_model("qwen3-30b-a3b-fp8", tp=1)
    dev = torch.device("cuda")
    blocks = [_Block(moekit.MoELayer(make_weights(spec.shape, spec.scheme, dev, seed=i), spec.routing, "triton"))
              for i in range(3)]
    stats = torch._dynamo.utils.counters["stats"]
    graphs_before = stats["unique_graphs"]
    with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
        compiled = [torch.compile(b, fullgraph=True, mode="reduce-overhead") for b in blocks]
        for call in range(3):
            for block, fn in zip(blocks, compiled):
                x = torch.randn(32, spec.shape.hidden, device=dev, dtype=torch.bfloat16)
                logits = torch.randn(32, spec.shape.num_experts, device=dev)
                got = fn(x, logits).clone()
                assert torch.equal(got, block.forward(x, logits)), call
    graphs = stats["unique_graphs"] - graphs_before
    assert graphs <= 2, graphs


def test_generate_with_a_static_cache_compiles_through_moekit(device):
    """transformers' generate() with a static cache compiles the decoding forward with
    fullgraph=True (its compile_config; on the CPU only when asked to, _compile_all_devices):
    with moekit's experts it must compile and, compiled with aot_eager (the same aten ops as
    eager), give the greedy tokens of eager decoding."""
    pytest.importorskip("transformers", minversion="5.0")
    import torch._dynamo.utils
    from transformers import CompileConfig

    import moekit.hf as mh
    from test_hf_tiny import tiny_model

    backend = "triton" if device.type == "cuda" else "reference"
    model = tiny_model("qwen3_moe").to(device).eval()
    mh.patch_model(model, scheme="fp8-block128", backend=backend)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    eager = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static", disable_compile=True)
    config = CompileConfig(fullgraph=True, backend="aot_eager")
    config._compile_all_devices = True
    torch._dynamo.utils.counters.clear()
    compiled = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static",
                              compile_config=config)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert torch.equal(compiled, eager)


def test_a_subclass_forward_runs_compiled_too(device):
    """The op runs the module's own _forward_eager: a subclass that overrides it is not bypassed
    once compiled."""

    class Doubled(moekit.MoELayer):
        def _forward_eager(self, x, *routing):
            return 2 * super()._forward_eager(x, *routing)

    weights = random_weights(E, H, N, "bf16", device=device)
    layer = Doubled(weights, RoutingConfig(top_k=K), "torch")
    plain = moekit.MoELayer(weights, RoutingConfig(top_k=K), "torch")
    x, logits = random_x(5, H, device=device), torch.randn(5, E).to(device)
    got = _compiled(layer)(x, logits)
    assert torch.equal(got, layer(x, logits)) and torch.equal(got, 2 * plain(x, logits))
