"""Integer arithmetic of launch code (grids, padded sizes), in plain Python.

triton.cdiv and triton.next_power_of_2 are constexpr functions since triton 3.5: called from
host code they unwrap their arguments first, 1-2 µs a call, and a layer's launch code made 11
such calls (the dev CPU: about 20 µs of a 100 µs eager fused_moe host path).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()
