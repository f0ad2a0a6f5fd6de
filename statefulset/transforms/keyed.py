"""Keyed randomness: a transform's random draws as a pure function of (spec seed, encoder, sample id).

Energon's ``@stateless(restore_seeds=True)`` seeds the global RNGs from the worker's seed and a
per-worker call counter, so a random transform replays only while ``world_size × num_workers``
stays the same. Here the counter is the sample's global position instead: a key of ``(spec seed,
encoder identity, method)`` and the ``sample_id`` give every sample its own draws (the global RNGs
seeded from a keyed hash of the two; an ``rng`` parameter gets a Philox generator keyed by both),
whichever rank, worker or resume point computes it.

:func:`stateless` marks a method; the loader (:mod:`statefulset.transforms.encoder`) then calls it
inside :func:`keyed_globals`, which seeds ``random``, numpy's global RNG and torch's CPU RNG from
the key and puts the three states back afterwards. torch is imported only when a keyed method
runs, so ``import statefulset`` stays free of it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import random
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy

_MASK64 = (1 << 64) - 1
# Set by the loader around each call, so that a decorated method called through it keys its draws
# by the spec's seed; a direct call (a notebook, a unit test) keys them by seed 0.
_context = threading.local()


def base_key(seed: int, identity: str, purpose: str) -> int:
    """64 bits naming one stream of keys: the spec's seed, the encoder's identity and what draws."""
    digest = hashlib.blake2b(f"{int(seed)}|{identity}|{purpose}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def keyed_generator(key: int, sample_id: int) -> numpy.random.Generator:
    """A Philox generator whose 128-bit key is ``(key, sample_id)``: independent per sample, no state."""
    return numpy.random.Generator(numpy.random.Philox(key=((key & _MASK64) << 64) | (int(sample_id) & _MASK64)))


class Rekeyed:
    """One Philox generator, re-keyed for each call: what :func:`keyed_generator` gives (the same state,
    so the same draws), without building a bit generator per sample (~15 µs, most of it the OS
    entropy of a SeedSequence that a keyed Philox never uses). The state is handed to numpy's setter
    as one reused dict of Python ints (tuples), not numpy arrays: the setter copies it element by
    element, and indexing a uint64 array there cost half of each re-keying. The generator handed out
    is valid for the call it was made for; the next call re-keys it."""

    def __init__(self) -> None:
        self.bits = numpy.random.Philox(key=0)
        self.generator = numpy.random.Generator(self.bits)
        # A fresh Philox's state: counter 0, the key's low word first, the buffer empty.
        self._words: dict[str, Any] = {"counter": (0, 0, 0, 0), "key": (0, 0)}
        self._state = {
            "bit_generator": "Philox",
            "state": self._words,
            "buffer": (0, 0, 0, 0),
            "buffer_pos": 4,
            "has_uint32": 0,
            "uinteger": 0,
        }

    def __call__(self, key: int, sample_id: int) -> numpy.random.Generator:
        self._words["key"] = (int(sample_id) & _MASK64, key & _MASK64)
        self.bits.state = self._state  # copied into the bit generator, not kept
        return self.generator


def _torch() -> Any:
    import torch

    return torch


def save_globals() -> tuple[Any, Any, Any]:
    """The states of ``random``, numpy's global RNG and torch's CPU RNG."""
    return random.getstate(), numpy.random.get_state(), _torch().get_rng_state()


def restore_globals(state: tuple[Any, Any, Any]) -> None:
    random.setstate(state[0])
    numpy.random.set_state(state[1])
    _torch().set_rng_state(state[2])


def global_seeds(key: int, sample_id: int) -> tuple[int, int, int]:
    """The seeds of ``random``, numpy's global RNG (32 bits: its legacy seeding) and torch's CPU RNG
    for ``(key, sample_id)``: a keyed hash of the pair (BLAKE2b), a pure function of the counter."""
    return GlobalSeeder(key).seeds(sample_id)


def seed_globals(key: int, sample_id: int) -> None:
    """Seed the three global RNGs from ``(key, sample_id)`` (torch's CPU generator only: ``torch.manual_seed``
    would also seed every accelerator's, at ~100x the cost)."""
    GlobalSeeder(key)(sample_id)


# random.seed(n) for an int n is the C generator's seed(n), then gauss_next = None (random.py, 3.9+).
_C_SEED = random.Random.__mro__[1].seed
_SEEDS = struct.Struct("<QIQ")  # the digest's three seeds: bytes 0-8, 8-12, 12-20


class GlobalSeeder:
    """:func:`seed_globals` for one key, with less work per call (the same seeds, the same states): the
    keyed BLAKE2b state made once and copied per call (a keyed hash otherwise compresses the key's
    block each time), the seeds read in one unpack, and ``random``'s generator seeded by its C method
    when it is the module's plain ``random.Random`` (``random.seed`` adds only type checks to it)."""

    def __init__(self, key: int) -> None:
        self.hash = hashlib.blake2b(key=(key & _MASK64).to_bytes(8, "little"), digest_size=20)

    def seeds(self, sample_id: int) -> tuple[int, int, int]:
        h = self.hash.copy()
        h.update((int(sample_id) & _MASK64).to_bytes(8, "little"))
        first, second, third = _SEEDS.unpack(h.digest())
        return first, second, third >> 1

    def __call__(self, sample_id: int) -> None:
        first, second, third = self.seeds(sample_id)
        inst = getattr(random.seed, "__self__", None)
        if type(inst) is random.Random:
            _C_SEED(inst, first)
            inst.gauss_next = None
        else:
            random.seed(first)
        numpy.random.seed(second)
        _torch().default_generator.manual_seed(third)


@contextlib.contextmanager
def keyed_globals(key: int, sample_id: int) -> Iterator[None]:
    """Inside: the global RNGs seeded from the key; after: their states as they were before."""
    saved = save_globals()
    try:
        seed_globals(key, sample_id)
        yield
    finally:
        restore_globals(saved)


@contextlib.contextmanager
def loader_seed(seed: int) -> Iterator[None]:
    """The spec seed a decorated method called directly inside this block keys its draws by."""
    before = getattr(_context, "seed", None)
    _context.seed = int(seed)
    try:
        yield
    finally:
        _context.seed = before


def encoder_identity(encoder: Any) -> str:
    """``module.QualifiedName`` of the encoder's class, with ``@version`` when it has a ``version``."""
    cls = type(encoder)
    name = f"{cls.__module__}.{cls.__qualname__}"
    version = getattr(encoder, "version", None)
    return name if version is None else f"{name}@{version}"


def restores_seeds(fn: Any) -> bool:
    """Whether ``fn`` is marked ``stateless(restore_seeds=True)``: by us, or by megatron.energon's decorator
    (which wraps the function in ``seed_wrapper`` with ``functools.wraps`` and sets ``__stateless__``)."""
    fn = getattr(fn, "__func__", fn)
    if getattr(fn, "__statefulset_restore_seeds__", False):
        return True
    code = getattr(fn, "__code__", None)
    return (
        bool(getattr(fn, "__stateless__", False))
        and hasattr(fn, "__wrapped__")
        and code is not None
        and code.co_name in ("seed_wrapper", "seed_wrapper_generator")
        and "megatron/energon" in code.co_filename.replace("\\", "/")
    )


def unwrapped(fn: Any) -> Any:
    """The user's function under our or Energon's seeding wrapper (those are applied by the loader itself)."""
    fn = getattr(fn, "__func__", fn)
    while restores_seeds(fn) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def takes_rng(fn: Any) -> bool:
    """Whether the function has a parameter named ``rng`` (it then receives the keyed generator)."""
    try:
        return "rng" in inspect.signature(unwrapped(fn)).parameters
    except (TypeError, ValueError):
        return False


def stateless(
    fn: Callable[..., Any] | None = None, *, restore_seeds: bool = False, failure_tolerance: int | None = None
) -> Any:
    """Mark a task-encoder method as a pure function of its sample (Energon's decorator, same signature).

    With ``restore_seeds=True``, ``random``, numpy's global RNG and torch's CPU RNG are seeded, for
    the call, from the spec's seed, the encoder's identity and the sample's ``sample_id``, and put
    back as they were afterwards. ``failure_tolerance`` is accepted for Energon code and ignored: a
    sample that fails to encode stops the loader with an error naming it (skipping it would change
    the stream).
    """
    if fn is None:
        return functools.partial(stateless, restore_seeds=restore_seeds, failure_tolerance=failure_tolerance)
    if not restore_seeds:
        fn.__stateless__ = True  # type: ignore[attr-defined]
        return fn

    @functools.wraps(fn)
    def keyed(self: Any, sample: Any, *args: Any, **kwargs: Any) -> Any:
        # A direct call: the loader calls the function under ``__wrapped__`` inside its own keying.
        sample_id = getattr(sample, "sample_id", None)
        if sample_id is None:
            return fn(self, sample, *args, **kwargs)
        seed = getattr(_context, "seed", None) or 0
        with keyed_globals(base_key(seed, encoder_identity(self), fn.__name__), sample_id):
            return fn(self, sample, *args, **kwargs)

    keyed.__stateless__ = True  # type: ignore[attr-defined]
    keyed.__statefulset_restore_seeds__ = True  # type: ignore[attr-defined]
    return keyed
