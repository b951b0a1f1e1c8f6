"""moekit inside Hugging Face transformers (v5): FP8 MoE experts without dequantizing.

    import moekit.hf                                   # registers experts_implementation="moekit"
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moekit")   # bf16 experts
    model = moekit.hf.from_pretrained(path)            # FP8 checkpoints: experts stay FP8
    model = moekit.hf.from_pretrained(path, scheme="fp8-channel-token")   # quantize bf16 on load
    moekit.hf.patch_model(model)                       # an already loaded model
    moekit.hf.fuse_routers(model)                      # routers through moekit.route (opt-in)
    moekit.hf.warmup(model, max_batch_size=8192)       # compile the kernels ahead of serving
    moekit.hf.save_pretrained(model, out)              # compressed-tensors FP8 checkpoint

Importing this module imports transformers; `import moekit` alone never does.
"""

from .compile_ahead import warmup
from .experts import (IMPLEMENTATION, MoekitExperts, experts_modules, experts_nbytes, moekit_experts_forward, register,
                      set_backend)
from .families import FAMILIES, UnsupportedModelError
from .load import from_pretrained, patch_model, quantize_model
from .routers import fuse_routers, unfuse_routers
from .save import save_pretrained

register()

__all__ = [
    "IMPLEMENTATION",
    "FAMILIES",
    "MoekitExperts",
    "UnsupportedModelError",
    "experts_modules",
    "from_pretrained",
    "fuse_routers",
    "moekit_experts_forward",
    "patch_model",
    "quantize_model",
    "register",
    "save_pretrained",
    "set_backend",
    "unfuse_routers",
    "experts_nbytes",
    "warmup",
]
