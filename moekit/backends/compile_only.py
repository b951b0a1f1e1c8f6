"""Compile-only mode, shared by every backend's Triton launches (the triton backend's kernels and
the glue that cutlass and torch share): within `compile_only()`, `launch` compiles a kernel for
the arguments it is given (into Triton's in-process and on-disk caches) and launches nothing.
`moekit tune` compiles its configs this way in helper processes, and `moekit.warmup` every
kernel a batch size would launch, on empty inputs that nothing reads."""

from __future__ import annotations

import contextlib
import contextvars

from .. import env

_COMPILE_ONLY = contextvars.ContextVar("moekit_compile_only", default=False)


@contextlib.contextmanager
def compile_only():
    """Within it, Triton kernels launched through `launch` are compiled, not launched. Inputs may
    be empty tensors of the right shapes and dtypes; outputs hold nothing."""
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


def compiling_only() -> bool:
    """Whether this thread is inside compile_only()."""
    return _COMPILE_ONLY.get()


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), or within compile_only() its compilation alone (nothing
    under the interpreter, which compiles nothing)."""
    if not _COMPILE_ONLY.get():
        kernel[grid](*args, **kwargs)
    elif not env.interpreting():
        kernel.warmup(*args, grid=grid, **kwargs)
