"""Test set-up. Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be
set before any kernel is defined, so it is set here, before the tests import moekit."""

import os

# The interpreter runs tl.dot as numpy's matmul, and a multi-threaded OpenBLAS splits a product
# between threads by its shape, summing some rows in another order: a token's row then depends on
# which tile rows it shares (on one CPU, 2 cores, a split call's bf16 rows differed in their last
# bits from one call's). A GPU's MMA gives each row the same sums wherever it sits, which is what
# the bitwise tests check; one BLAS thread gives the interpreter that property too. Set before
# torch imports numpy (which loads OpenBLAS and reads this once).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _read_e4m3_nan_as_a_gpu_does():
    """Triton's interpreter (3.9) widens e4m3's NaN byte (0x7F, 0xFF) to +-480, in casts and in
    tl.dot: it decodes the format without its NaN. A GPU reads NaN. The NaN tests
    (test_nan_propagation.py) need the GPU's reading to show on the CPU that the kernels carry a
    NaN through, so the interpreter's widening gets it here, for the tests only: no other test
    data holds that byte (the kernels clamp to +-448, 0x7E, before FP8)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    widen = interpreter._convert_float
    nan_bits = {(16, 10): 0x7E00, (16, 7): 0x7FC0, (32, 23): 0x7FC00000}  # fp16, bf16, fp32

    def widen_keeping_nan(data, input_dtype, output_dtype, rounding_mode):
        out = widen(data, input_dtype, output_dtype, rounding_mode)
        key = (output_dtype.primitive_bitwidth, output_dtype.fp_mantissa_width)
        if input_dtype == tl.float8e4nv and key in nan_bits:
            out = np.where((np.asarray(data) & 0x7F) == 0x7F, out.dtype.type(nan_bits[key]), out)
        return out

    interpreter._convert_float = widen_keeping_nan


from moekit import env as _moekit_env  # noqa: E402 - after TRITON_INTERPRET is set above

if _moekit_env.interpreting():  # Triton's own reading ("1", "true", "on")
    _read_e4m3_nan_as_a_gpu_does()


@pytest.fixture(autouse=True)
def fresh_table_lookups():
    """Each test starts with no table lookup remembered (moekit.tables.memoized): tests write
    their own tables, often under the same names."""
    from moekit import tables

    tables.clear_cache()
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def registry(monkeypatch):
    """Register extra backends for one test; the registry and select's cache are restored after."""
    import moekit.select
    from moekit.backends import base

    monkeypatch.setattr(moekit.select, "_supports_cache", {})

    def add(backend):
        monkeypatch.setitem(base._REGISTRY, backend.name, backend)
        return backend

    return add


@pytest.fixture
def interpreter_asserts(monkeypatch):
    """device_assert on in Triton's interpreter for this test (helpers.interpreter_asserts_on)."""
    from helpers import interpreter_asserts_on

    interpreter_asserts_on(monkeypatch)


@pytest.fixture
def interpret_switchable(monkeypatch):
    """For tests of how TRITON_INTERPRET is read, which set it after moekit was imported: moekit
    refuses that (env.interpreting: the kernels were defined one way for good), so the record of
    how they were defined is cleared for the test. No kernel may run in such a test."""
    monkeypatch.setattr(_moekit_env, "_KERNELS_INTERPRETED", None)
