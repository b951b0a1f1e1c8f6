"""Test set-up. Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be
set before any kernel is defined, so it is set here, before the tests import moekit."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
