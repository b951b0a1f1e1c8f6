"""transformers models with their experts on moekit's GPU backends (marked gpu: run on the device).

Needs only transformers (on the device image), not compressed-tensors: tiny bf16 models are
quantized in place by `moekit.hf.patch_model`, then run with the experts on `reference` and on
each GPU backend. Both compute the same quantized problem, so their next-token distributions must
agree at least as well as the CPU tests require of FP8 against bf16 (test_hf_load's KL < 0.04,
top-1 >= 0.75, derived there); the kernels' own error is ~1e-2 relative L2 per layer.
"""

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")

import moekit  # noqa: E402
import moekit.hf as mh  # noqa: E402

from test_hf_tiny import tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu

KL_MAX, TOP1_MIN = 0.04, 0.75
CASES = [("mixtral", "fp8-channel-token"), ("qwen3_moe", "fp8-block128"), ("deepseek_v3", "fp8-block128"),
         ("glm4_moe", "fp8-channel-token"), ("llama4", "fp8-tensor-dynamic")]


def _compare(a, b):
    la, lb = a.float().log_softmax(-1), b.float().log_softmax(-1)
    return float((lb.exp() * (lb - la)).sum(-1).mean()), float((a.argmax(-1) == b.argmax(-1)).float().mean())


@pytest.mark.parametrize("family,scheme", CASES)
def test_gpu_backends_run_a_whole_model(family, scheme):
    model = tiny_model(family).cuda().eval()
    mh.patch_model(model, scheme=scheme, backend="reference")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1)).cuda()
    modules = mh.experts_modules(model).values()
    shape = next(iter(modules)).moe_weights().shape(2)
    with torch.no_grad():
        want = model(ids).logits
        ran = []
        for backend in ("triton", "cutlass"):
            if moekit.get_backend(backend).supports(shape, moekit.get_scheme(scheme), torch.device("cuda")):
                continue  # e.g. cutlass on block weights: says why in supports()
            assert mh.set_backend(model, backend) == len(modules)
            kl, top1 = _compare(model(ids).logits, want)
            assert kl < KL_MAX and top1 >= TOP1_MIN, (backend, kl, top1)
            ran.append(backend)
    assert "triton" in ran


@pytest.mark.parametrize("family,scheme", [("qwen3_moe", "fp8-block128"), ("glm4_moe", "fp8-channel-token")])
def test_gpu_load_fp8_checkpoint_without_bf16_experts(family, scheme, tmp_path):
    """A compressed-tensors FP8 checkpoint (written by moekit.hf.save_pretrained) loads straight
    onto the GPU: the experts stay FP8, no bf16 copy of them is ever allocated, and the model runs
    on triton as it does on the reference. transformers itself refuses to read the checkpoint's
    quantization config without compressed-tensors (seen on the device image, which lacks it:
    carry device-wheels/, scripts/gpu_check.sh installs them)."""
    pytest.importorskip("compressed_tensors", reason="transformers reads compressed-tensors configs only with it")
    from test_hf_tiny import EXPERTS, HIDDEN, INTER

    tiny_model(family).save_pretrained(tmp_path / "bf16")
    mh.save_pretrained(mh.from_pretrained(tmp_path / "bf16", scheme=scheme, backend="reference"), tmp_path / "fp8")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model = mh.from_pretrained(tmp_path / "fp8", backend="triton", device_map="cuda").eval()
    torch.cuda.synchronize()
    final, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    modules = mh.experts_modules(model)
    assert all(m.moe_weights().w13.device.type == "cuda" for m in modules.values())
    assert all(m.moe_weights().w13.dtype == torch.float8_e4m3fn for m in modules.values())
    # a bf16 copy of even half of one layer's experts during the load would push the peak past this
    one_layer_bf16 = EXPERTS * 3 * INTER * HIDDEN * 2
    assert peak - final < one_layer_bf16 / 2, (peak, final, one_layer_bf16)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        got = model(ids).logits
        mh.set_backend(model, "reference")
        want = model(ids).logits
    kl, top1 = _compare(got, want)
    assert kl < KL_MAX and top1 >= TOP1_MIN, (kl, top1)
