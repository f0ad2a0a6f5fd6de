"""64-bit keys derived from integers: the seeds of native packing's permutations and of loader workers.

``derive_key(seed, source, split)`` names a source's permutation, ``derive_key(key, epoch)`` an
epoch's, ``derive_key(seed, seed_offset, rank, worker)`` a worker's seed: order-sensitive,
well spread (splitmix64's finaliser), the same on every machine.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def mix64(value: int) -> int:
    """splitmix64's finaliser on a Python int: a fixed, well-spread 64-bit hash."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def derive_key(*parts: int) -> int:
    """One 64-bit key from several integers (seed, epoch, source ...), order-sensitive."""
    key = 0x243F6A8885A308D3
    for part in parts:
        key = mix64(key ^ (int(part) & _MASK64))
    return key
