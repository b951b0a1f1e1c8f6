"""The launch code's integer helpers (backends/sizes.py) against triton's own."""

from __future__ import annotations

import pytest
import triton

from moekit.backends.sizes import cdiv, next_pow2


@pytest.mark.parametrize("b", [1, 2, 3, 16, 128, 1000])
def test_cdiv_is_tritons(b):
    for a in range(0, 3 * b + 5):
        assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_pow2_is_tritons():
    for n in [*range(1, 1100), 2**20 - 1, 2**20, 2**20 + 1, 2**31 + 5]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    assert next_pow2(0) == 1  # a padded size of nothing is still one lane (triton's gives 0)
