"""The compile options moekit passes to every Triton and Gluon kernel it launches on a GPU.

FP fusion (a * b + c compiled as one fused multiply-add, one rounding instead of two) is part of
every kernel's roundings: the accuracy bounds of the tests and of `moekit check` were derived
with it, the Gluon kernels are bitwise the Triton kernels they mirror with it (both fuse alike),
and the shipped tables were timed with it. Triton 3.6 fuses by default; 3.9 warns that 3.10 will
not (TRITON_DEFAULT_FP_FUSION). Asking for it by name keeps the same results on every Triton from
3.6 on, without touching the user's other kernels through the environment. (A user who sets
TRITON_FORCE_DISABLE_FP_FUSION still wins: Triton ignores the request then.)
"""

FP_FUSION = {"enable_fp_fusion": True}


def compile_options(interpreting: bool) -> dict:
    """The options to pass with a launch; none under TRITON_INTERPRET=1, which compiles nothing
    and takes no compile options."""
    return {} if interpreting else dict(FP_FUSION)


def _assert_options() -> dict:
    """Compile options of the kernels that assert on their inputs (the expert ids, the router
    logits): Triton's `debug`, which compiles device_assert in (without it an assertion compiles to
    nothing), without the integer-overflow checks it would add everywhere else."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # no NVIDIA backend in this Triton: nothing is compiled for a GPU here
        return {"debug": True}
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return {"debug": True, **({"sanitize_overflow": False} if "sanitize_overflow" in fields else {})}


ASSERT_OPTIONS = _assert_options()
