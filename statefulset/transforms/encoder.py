"""A task encoder as the loader runs it: checked once, then applied to each micro-batch in the workers.

Energon's method names (``encode_sample``, optional ``batch``, optional ``encode_batch``) on any
object or on a subclass of megatron-energon's ``TaskEncoder`` / ``DefaultTaskEncoder``; hooks
that cannot be exact are refused (:mod:`statefulset.transforms.hooks`). A method marked
``stateless(restore_seeds=True)`` (ours or Energon's) runs with the global RNGs keyed by
``(spec seed, encoder identity, method, sample_id)`` (:mod:`statefulset.transforms.keyed`);
``batch`` and ``encode_batch`` are keyed by the micro-batch's first ``sample_id``. A method with
an ``rng`` parameter receives a Philox ``numpy.random.Generator`` keyed the same way.

An unmarked method that draws from a global RNG would draw differently in every worker and after
every resume: the first calls in each process compare the global RNG states before and after, and
the first change is logged once at WARNING.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from operator import is_
from typing import Any

import numpy

from statefulset.errors import StatefulsetError
from statefulset.index.compiled import module_function
from statefulset.transforms.collate import collate
from statefulset.transforms.hooks import hook, refuse_hooks
from statefulset.transforms.keyed import (
    GlobalSeeder,
    Rekeyed,
    base_key,
    encoder_identity,
    restore_globals,
    restores_seeds,
    save_globals,
    takes_rng,
    unwrapped,
)
from statefulset.transforms.sample import TokenSample

_log = logging.getLogger("statefulset")
# Calls per process whose global-RNG use is checked (a comparison of torch's 5 KB state each).
_CHECKED_CALLS = 8
_warned: set[str] = set()
# A TokenSample's attributes in the order its constructor takes them (and its __dict__ holds them).
_MADE = tuple(f.name for f in dataclasses.fields(TokenSample))


class _Method:
    """One hook, with how to call it: keyed globals or not, an ``rng`` or not."""

    def __init__(self, encoder: Any, name: str, bound: Any, seed: int, identity: str) -> None:
        self.name = name
        self.keyed = restores_seeds(bound)
        self.rng = takes_rng(bound)
        # The user's function under a seeding wrapper, called with the encoder: the keying is ours.
        function = unwrapped(bound)
        self.call: Callable[..., Any] = (
            (lambda *args, **kw: function(encoder, *args, **kw)) if function is not getattr(bound, "__func__", bound)
            else bound
        )  # fmt: skip
        self.key = base_key(seed, identity, name)
        self.seed_globals = GlobalSeeder(self.key) if self.keyed else None
        self.rng_key = base_key(seed, identity, name + "/rng")
        self.generator = Rekeyed() if self.rng else None  # keyed_generator's draws, re-keyed per call


class TaskEncoderRunner:
    """The encoder of a dataset: what the workers call per micro-batch, and its identity for states."""

    def __init__(self, encoder: Any, seed: int, where: str = "task_encoder") -> None:
        refuse_hooks(encoder, where)
        self.encoder = encoder
        self.identity = encoder_identity(encoder)
        self.seed = int(seed)
        self.encode = _Method(encoder, "encode_sample", encoder.encode_sample, self.seed, self.identity)
        methods = {name: hook(encoder, name) for name in ("batch", "encode_batch")}
        self.batch = _Method(encoder, "batch", methods["batch"], self.seed, self.identity) if methods["batch"] else None
        self.encode_batch = (
            _Method(encoder, "encode_batch", methods["encode_batch"], self.seed, self.identity)
            if methods["encode_batch"]
            else None
        )
        self.keyed = any(m is not None and m.keyed for m in (self.encode, self.batch, self.encode_batch))
        self._checks_left = _CHECKED_CALLS

    def __getstate__(self) -> dict[str, Any]:
        return {"encoder": self.encoder, "seed": self.seed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["encoder"], state["seed"])  # type: ignore[misc]

    def describe(self) -> str:
        """The encoder and its key, as ``explain`` names them."""
        return f"{self.identity} (keyed by spec seed {self.seed} and sample_id)"

    def _run(self, method: _Method, sample_id: int, argument: Any) -> Any:
        kwargs = {"rng": method.generator(method.rng_key, sample_id)} if method.generator is not None else {}
        try:
            if method.seed_globals is not None:  # the caller saved the global states and puts them back (_globals_kept)
                method.seed_globals(sample_id)
                return method.call(argument, **kwargs)
            if self._checks_left <= 0:
                return method.call(argument, **kwargs)
            self._checks_left -= 1
            before = save_globals()
            result = method.call(argument, **kwargs)
            self._check_globals(method.name, before)
            return result
        except StatefulsetError as exc:
            named(exc, sample_id)
            raise
        except Exception as exc:
            raise self._failure(method.name, sample_id, exc) from exc

    def _failure(self, name: str, sample_id: Any, exc: Exception) -> StatefulsetError:
        """The error naming this encoder, the hook ``name`` and the sample (or micro-batch) it failed on."""
        what = f"sample {sample_id}" if name == "encode_sample" else f"the micro-batch from {sample_id}"
        message = f"task encoder {self.identity}: {name} failed on {what}: {type(exc).__name__}: {exc}"
        return named(StatefulsetError(message), sample_id)

    def _check_globals(self, name: str, before: tuple[Any, Any, Any]) -> None:
        after = save_globals()
        changed = [
            label
            for label, same in (
                ("random", before[0] == after[0]),
                ("numpy.random", _same_numpy(before[1], after[1])),
                ("torch", bool((before[2] == after[2]).all())),
            )
            if not same
        ]
        if changed and self.identity + name not in _warned:
            _warned.add(self.identity + name)
            self._checks_left = 0
            _log.warning(
                "statefulset: task encoder %s: %s draws from the global RNG(s) %s without "
                "@stateless(restore_seeds=True): its draws then depend on the worker and the resume point, "
                "not on the sample; decorate it (statefulset.stateless or megatron.energon.stateless) or take an "
                "`rng` parameter (docs/transforms.md)",
                self.identity,
                name,
                ", ".join(changed),
            )

    @contextlib.contextmanager
    def _globals_kept(self, keep: bool = True) -> Iterator[None]:
        """The global RNG states as they were, after keyed calls: saved once per micro-batch, not per call
        (~0.2 ms), as nothing else runs between the calls of one micro-batch. ``keep=False``: the caller
        keeps them (:meth:`saved_globals`)."""
        if not self.keyed or not keep:
            yield
            return
        saved = save_globals()
        try:
            yield
        finally:
            restore_globals(saved)

    def saved_globals(self) -> Any:
        """For a DataLoader worker, which puts the global RNG states back once per hand-off instead of
        per micro-batch: the states now (None when no method is keyed); give them to :meth:`restore`."""
        return save_globals() if self.keyed else None

    @staticmethod
    def restore(saved: Any) -> None:
        """Put back the global RNG states :meth:`saved_globals` returned."""
        restore_globals(saved)

    def sample(self, rows: dict[str, numpy.ndarray], i: int, sample_id: int, source: str) -> Any:
        """Row ``i`` of a micro-batch's fields, as a TokenSample, encoded (``ds[p]``)."""
        with self._globals_kept():
            return self._sample(rows, i, int(sample_id), source)

    def _sample(self, rows: dict[str, Any], i: int, sample_id: int, source: str) -> Any:
        sample = TokenSample(text=rows["text"][i], sample_id=sample_id, source=source)
        for name, values in rows.items():
            if name != "text":
                setattr(sample, name, values[i])
        encoded = self._run(self.encode, sample_id, sample)
        self._refuse_result(encoded, sample_id)
        return encoded

    def _refuse_result(self, encoded: Any, sample_id: int) -> None:
        if encoded is None or hasattr(encoded, "__next__"):
            message = (
                f"task encoder {self.identity}: encode_sample returned "
                f"{'None' if encoded is None else 'an iterator'} for sample {sample_id}: it must return one sample "
                "(skipping or multiplying samples would make the stream depend on more than the position)"
            )
            raise named(StatefulsetError(message), sample_id)

    def micro_batch(
        self, rows: dict[str, numpy.ndarray], sample_ids: numpy.ndarray, sources: list[str], keep: bool = True
    ) -> Any:
        """One micro-batch, encoded: ``batch`` (or the default collate) then ``encode_batch``; the global
        RNG states put back afterwards unless ``keep=False`` (the caller does: :meth:`saved_globals`)."""
        with self._globals_kept(keep):
            if self.encode_in_place(rows, sample_ids):
                return self.batched(self.as_samples(rows, sample_ids, sources), int(sample_ids[0]))
            return self.batched(self.encoded_samples(rows, sample_ids, sources), int(sample_ids[0]))

    def encoded_samples(self, rows: dict[str, Any], sample_ids: numpy.ndarray, sources: list[str]) -> list:
        """A micro-batch's rows, each through ``encode_sample`` (inside the caller's :meth:`_globals_kept`);
        ``rows``: each field's ``[B, ...]`` array, or the list of its rows' views."""
        return self.encode_rows(rows, sample_ids, sources)[0]

    def encode_rows(self, rows: dict[str, Any], sample_ids: numpy.ndarray, sources: list[str]) -> tuple[list, bool]:
        """:meth:`encoded_samples`, and whether every sample came back *kept*: ``encode_sample`` returned
        the very TokenSample made for it, holding the very objects it was made with and nothing added
        (an identity, or changes made in place only). The samples' fields are then ``rows``' own.

        The same calls as :meth:`_sample` per sample, with less Python around them: the TokenSample made
        positionally, and once the global-RNG checks are done, an unkeyed method called directly."""
        ids = sample_ids.tolist()
        if any(name not in _MADE for name in rows):  # a field a TokenSample does not declare
            return [self._sample(rows, i, p, sources[i]) for i, p in enumerate(ids)], False
        given = {"sample_id": ids, "source": sources, **rows}
        nothing = [None] * len(ids)
        columns = [given.get(name, nothing) for name in _MADE]
        method = self.encode
        plain = not method.keyed and method.generator is None
        if plain and self._checks_left <= 0:
            return self._encode_plain(columns)
        samples = []
        kept = True
        made: tuple[Any, ...] = ()
        try:
            for made in zip(*columns, strict=True):
                sample = TokenSample(*made)
                if plain and self._checks_left <= 0:
                    encoded = method.call(sample)
                else:
                    encoded = self._run(method, made[1], sample)
                if encoded is not sample:
                    kept = False
                    self._refuse_result(encoded, made[1])
                elif kept:
                    values = sample.__dict__
                    kept = len(values) == len(_MADE) and all(map(is_, values.values(), made))
                samples.append(encoded)
        except StatefulsetError as exc:
            named(exc, made[1])
            raise
        except Exception as exc:  # as _run names it
            raise self._failure("encode_sample", made[1], exc) from exc
        return samples, kept

    def _encode_plain(self, columns: list[Any]) -> tuple[list, bool]:
        """:meth:`encode_rows`' loop for an unkeyed ``encode_sample`` without ``rng`` once the global-RNG
        checks are done: the method called directly. Compiled where the kernels are (``encode_samples``
        in ``kernels_module.c``: each TokenSample made with its ``__dict__`` set as the dataclass's
        ``__init__`` sets it, then called, then judged kept by its attributes' identities and order),
        else :meth:`_encode_python`: the same samples, calls, refusals and errors."""
        loop = _compiled_loop()
        if loop is None:
            return self._encode_python(columns)
        samples: list[Any] = []
        lists = [c if type(c) is list else list(c) for c in columns]
        try:
            kept, stopped = loop(TokenSample, self.encode.call, _MADE, lists, samples)
        except StatefulsetError as exc:
            named(exc, lists[1][len(samples)])
            raise
        except Exception as exc:  # as _run names it
            raise self._failure("encode_sample", lists[1][len(samples)], exc) from exc
        if stopped >= 0:
            self._refuse_result(samples[-1], lists[1][stopped])
        return samples, kept

    def _encode_python(self, columns: list[Any]) -> tuple[list, bool]:
        """:meth:`_encode_plain` in Python: *kept* judged by unpacking the sample's attributes (a
        TokenSample's seven, in the order its constructor set them) instead of mapping ``is`` over
        them; an eighth attribute, or one deleted, fails the unpacking: not kept."""
        call = self.encode.call
        samples = []
        kept = True
        made: tuple[Any, ...] = ()
        try:
            for made in zip(*columns, strict=True):
                sample = TokenSample(*made)
                encoded = call(sample)
                samples.append(encoded)
                if encoded is not sample:
                    kept = False
                    self._refuse_result(encoded, made[1])
                elif kept:
                    try:
                        t, i, s, m, c, x, p = sample.__dict__.values()  # the TokenSample's fields, in order
                    except ValueError:
                        kept = False
                        continue
                    kept = (
                        t is made[0] and i is made[1] and s is made[2] and m is made[3]
                        and c is made[4] and x is made[5] and p is made[6]
                    )  # fmt: skip
        except StatefulsetError as exc:
            named(exc, made[1])
            raise
        except Exception as exc:  # as _run names it
            raise self._failure("encode_sample", made[1], exc) from exc
        return samples, kept

    def encode_in_place(self, rows: dict[str, Any], sample_ids: numpy.ndarray) -> bool:
        """Whether the encoder's own micro-batch path changed ``rows`` (each field's ``[B, ...]`` array)
        in place into exactly what ``encode_sample`` gives per sample (an ``encode_rows_in_place(rows,
        sample_ids, key)`` method, as FillInTheMiddle's compiled path; its ``rng`` keyed as here). False:
        nothing changed, encode per sample."""
        method = self.encode
        in_place = getattr(self.encoder, "encode_rows_in_place", None)
        if in_place is None or method.keyed or method.generator is None or not self.collates:
            return False
        try:
            return bool(in_place(rows, sample_ids, method.rng_key))
        except StatefulsetError:
            raise
        except Exception as exc:
            raise StatefulsetError(
                f"task encoder {self.identity}: encode_rows_in_place failed on the micro-batch from "
                f"{int(sample_ids[0])}: {type(exc).__name__}: {exc}"
            ) from exc

    def as_samples(self, rows: dict[str, Any], sample_ids: numpy.ndarray, sources: list[str]) -> list[TokenSample]:
        """The rows as TokenSamples, not encoded (after :meth:`encode_in_place`)."""
        samples = []
        for i, sample_id in enumerate(sample_ids.tolist()):
            sample = TokenSample(text=rows["text"][i], sample_id=sample_id, source=sources[i])
            for name, values in rows.items():
                if name != "text":
                    setattr(sample, name, values[i])
            samples.append(sample)
        return samples

    @property
    def rows_in_place(self) -> bool:
        """Whether the encoder has a micro-batch path changing int64 rows in place (``encode_rows_in_place``)."""
        return getattr(self.encoder, "encode_rows_in_place", None) is not None

    @property
    def collates(self) -> bool:
        """Whether batches are the default collate of the encoded samples (no ``batch``, no ``encode_batch``)."""
        return self.batch is None and self.encode_batch is None

    def batched(self, samples: list, first: int) -> Any:
        """Encoded samples as the micro-batch: ``batch`` (or the default collate) then ``encode_batch``."""
        if self.batch is None:
            out: Any = collate(samples, f"task encoder {self.identity}")
        else:
            out = self._run(self.batch, first, samples)
        if self.encode_batch is not None:
            out = self._run(self.encode_batch, first, out)
        return out


def named(error: StatefulsetError, sample_id: Any) -> StatefulsetError:
    """``error`` (ours, or one the encoder raised) marked with the sample it was raised for, as
    ``error.sample_id`` (a batch hook's: its micro-batch's first), unless it names one already: a worker
    that encoded a bundle of micro-batches in one call says which one failed (encoded_bundle)."""
    if getattr(error, "sample_id", None) is None:
        error.sample_id = sample_id  # type: ignore[attr-defined]
    return error


def _compiled_loop() -> Any:
    """The compiled ``encode_samples`` (None without the kernels, logged once by module_function), used
    only while TokenSample is made by ``object.__new__`` and holds the attributes ``_MADE`` names."""
    if TokenSample.__new__ is not object.__new__:
        return None
    return module_function("encode_samples")


def _same_numpy(a: Any, b: Any) -> bool:
    return a[0] == b[0] and numpy.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


def reset_warnings() -> None:
    """Forget which encoders were warned about (tests)."""
    _warned.clear()
