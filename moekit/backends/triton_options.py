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
