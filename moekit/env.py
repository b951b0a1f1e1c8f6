"""Environment variables read on every layer call, read cheaply.

os.environ.get costs about 1 µs per name that is not set (a KeyError raised and caught inside);
on POSIX os.environ keeps its values in the bytes dict `_data`, which os.environ's own setters
update (monkeypatch and os.environ[...] = ... included), and which reads in about 0.05 µs. The
dict is looked up on os.environ at every call, so an os.environ replaced by another mapping (a
test's mock) is read through its own get().
"""

from __future__ import annotations

import os

_POSIX = os.name == "posix"
_ENCODED: dict[str, bytes] = {}


def raw(name: str) -> bytes | str | None:
    """The variable's value as os.environ stores it (bytes on POSIX, str elsewhere), or None: for
    comparing and keying, not for showing (`value` decodes)."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if _POSIX and type(data) is dict:
        key = _ENCODED.get(name)
        if key is None:
            key = _ENCODED[name] = os.fsencode(name)
        return data.get(key)
    return environ.get(name)


def value(raw_value: bytes | str | None) -> str | None:
    """A `raw` value as a str."""
    return os.fsdecode(raw_value) if isinstance(raw_value, bytes) else raw_value


def get(name: str) -> str | None:
    """The variable as a str, or None (raw, decoded)."""
    return value(raw(name))


INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    """Whether moekit runs its Triton kernels in Triton's CPU interpreter: TRITON_INTERPRET as
    Triton itself reads it (triton.knobs: "1", "true", "on" in any case, and whatever else the
    installed Triton takes), so that moekit never launches interpreted kernels believing they are
    compiled ("true" once did: the kernels' interpreter fixes stayed off and the output was
    garbage). One rule for every module (the glue, the launch steps, supports()). Asked about 9
    times per layer call: Triton's answer is remembered per value of the variable. Raises
    RuntimeError (`interpreter_set_late`'s reason) where the kernels cannot run as it asks."""
    answer = _triton_interprets(raw(INTERPRET_ENV))
    if answer and _KERNELS_INTERPRETED is False:
        raise RuntimeError(INTERPRETER_SET_LATE)
    return answer


def interpreter_set_late() -> str | None:
    """Why moekit's Triton kernels cannot run now, or None: TRITON_INTERPRET turned on after
    moekit defined them for the GPU. For the triton backend's supports(), which refuses with it
    (`interpreting` would raise it), so that the backends that run no Triton kernel still run."""
    if _KERNELS_INTERPRETED is False and _triton_interprets(raw(INTERPRET_ENV)):
        return INTERPRETER_SET_LATE
    return None


def _triton_interprets(raw_value) -> bool:
    """Triton's reading of a TRITON_INTERPRET value (its env.raw), remembered per value."""
    answer = _INTERPRETING.get(raw_value)
    if answer is None:
        from triton import knobs  # imported here: env is read by modules that load before triton

        answer = _INTERPRETING[raw_value] = bool(knobs.runtime.interpret)
    return answer


INTERPRETER_SET_LATE = (
    f"{INTERPRET_ENV} was set after moekit was imported: Triton decides when a kernel is defined "
    f"(at import) whether the interpreter runs it, and moekit's kernels were defined for the GPU. "
    f"Set {INTERPRET_ENV}=1 before importing moekit (or torch/triton code that imports it)"
)


_KERNELS_INTERPRETED: bool | None = None  # None until moekit's package import records it


def record_kernels_defined() -> None:
    """Called once moekit's package has imported its kernel modules: whether Triton defined
    them for its interpreter (TRITON_INTERPRET as Triton read it then)."""
    from triton import knobs

    global _KERNELS_INTERPRETED
    _KERNELS_INTERPRETED = bool(knobs.runtime.interpret)


_INTERPRETING: dict = {}  # TRITON_INTERPRET's raw value -> Triton's reading of it
