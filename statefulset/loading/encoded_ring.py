"""Encoded samples that keep the dataset's layout, collated straight into the batch ring's slots.

An encoder without ``batch``/``encode_batch`` whose samples keep the dataset's fields (an identity,
or fill-in-the-middle, which changes tokens in place) gives batches the ring can carry
(:mod:`statefulset.loading.encoded`). Collating them first (a tensor per field, then checking the
layout on the tensors) cost more than the encoder itself; here the samples' arrays are checked
and copied once into *staged* arrays of the ring's row shapes (``text`` in int64, as collated),
which the worker then writes into its slot, or, when some batch of the bundle does not fit,
turns into the collated dict the default collate gives, tensor for tensor.

The ring of a dataset with a task encoder carries ``text`` in the corpus dtype (``ring.make_ring``): the
worker gathers each micro-batch's rows straight into its slot and the encoder's samples hold views of
them, ``text`` widened to int64 only where the encoder reads it (statefulset.transforms.sample). A
field the encoder kept (an identity never reads ``text``) is in the slot already (:attr:`Staged.home`:
:func:`write_slot` skips it); a field it replaced, or ``text`` it read (an int64 copy, changed or not),
is copied in, ``text`` narrowed back by :func:`narrowed` with its range checked in the same compiled
pass (``sf_narrow_tokens``): a batch with a token outside the dtype makes the worker send its bundle
another way (``BatchSource._send_encoded``). An encoder with a micro-batch path changing rows in place
(FillInTheMiddle's) gets an int64 ring, its rows changed in the slot itself.

A sample qualifies when it is a :class:`TokenSample` that holds exactly the ring's fields (no
others), each a numpy array (or numpy scalar) of the field's row shape and dtype (``text``: int64,
or the ring row it was never read from), and its ``sample_id`` is its position as an int. Anything
else goes through the default collate (statefulset.transforms.collate) and the layout check on its
result, as before.
"""

from __future__ import annotations

import dataclasses
from operator import is_
from typing import Any

import numpy
import torch

from statefulset.index.compiled import library, writable_address
from statefulset.streams.documents import FieldSpec
from statefulset.transforms.sample import DATASET_FIELDS, TokenSample, narrower_integers

_INT64 = numpy.dtype(numpy.int64)
# The ring's token dtypes by the kernel's kind numbers (kernels.c, SF_KINDS).
_KINDS = {
    numpy.dtype(t): k
    for k, t in enumerate((numpy.uint8, numpy.int8, numpy.int16, numpy.uint16, numpy.int32, numpy.int64))
}
_OWN_FIELDS = len(dataclasses.fields(TokenSample))  # a TokenSample's attributes when nothing was added


class Staged:
    """One micro-batch's fields as ``[batch_size, *shape]`` arrays (``text`` int64, or the ring's own rows),
    in the ring's order; the tokens not yet checked against the ring's dtype (:func:`write_slot` does)."""

    def __init__(self, arrays: dict[str, numpy.ndarray], positions: numpy.ndarray) -> None:
        self.arrays = arrays
        self.positions = positions
        # (slot view, row, that row's arrays): where the rows were gathered (BatchSource.encoded); a
        # field staged as that very array is already in the slot.
        self.home: tuple[dict[str, numpy.ndarray], int, dict[str, numpy.ndarray]] | None = None

    def placed(self, home: tuple[dict[str, numpy.ndarray], int] | None, rows: dict[str, Any] | None) -> Staged:
        """This batch, knowing that ``rows`` are the arrays of place ``home`` (``(slot view, i)``) of the
        ring, as made before anything was gathered or encoded (a field staged as another array is copied)."""
        if home is not None and rows is not None:
            self.home = (home[0], home[1], rows)
        return self

    def collated(self) -> dict[str, Any]:
        """What the default collate gives for the same samples: each field a tensor, then ``sample_id``."""
        out: dict[str, Any] = {name: torch.from_numpy(values) for name, values in self.arrays.items()}
        text = self.arrays.get("text")
        if text is not None and text.dtype != _INT64:  # rows kept in the ring's dtype: int64, as collated
            out["text"] = torch.from_numpy(numpy.array(text, dtype=numpy.int64))
        out["sample_id"] = torch.from_numpy(numpy.array(self.positions, dtype=numpy.int64))
        return out


def staged_names(fields: list[FieldSpec]) -> tuple[str, ...] | None:
    """A ring's field names, when they are in the order a TokenSample lists them; None: its batches
    are never staged. Asked once per micro-batch: the ring computes it once (``BatchRing.staged_names``)."""
    names = tuple(f.name for f in fields)
    order = [n for n in DATASET_FIELDS if n in names]
    return names if list(names) == order and len(order) == len(names) else None


def staged(
    samples: list[Any],
    fields: list[FieldSpec],
    names: tuple[str, ...] | None,
    positions: numpy.ndarray,
    rows: dict[str, numpy.ndarray] | None = None,
    views: dict[str, list[numpy.ndarray]] | None = None,
    kept: bool = False,
) -> Staged | None:
    """The samples staged for the ring (see the module's docstring), or None when they do not qualify.

    ``fields``, ``names``: the ring's fields and their :func:`staged_names`.
    ``rows``/``views``: the micro-batch's fields and the row views the samples were made from
    (:meth:`BatchSource.encoded`). A field whose every sample still holds its own row view (an
    identity, or a change made in place) is staged as ``rows``' array itself, without a copy.
    ``kept``: every sample is the TokenSample made from ``views`` and ``positions``, holding those
    very objects and nothing else (``TaskEncoderRunner.encode_rows``): then only ``rows`` is checked,
    once per micro-batch, not each sample.
    """
    if names is None:
        return None
    if kept and rows is not None:
        return _kept(rows, fields, names, positions)
    wanted = set(names) | {"text", "sample_id", "source"}
    absent = [n for n in DATASET_FIELDS if n not in wanted]  # the dataset fields the ring does not carry
    held = []
    for sample, position in zip(samples, positions.tolist(), strict=True):
        if type(sample) is not TokenSample or type(sample.sample_id) is not int or sample.sample_id != position:
            return None
        own = sample.__dict__
        if len(own) != _OWN_FIELDS and any(v is not None for k, v in own.items() if k not in wanted):
            return None  # a field the encoder added
        if any(own.get(name) is not None for name in absent):
            return None  # a dataset field the ring does not carry
        held.append(own)
    arrays = {}
    for f in fields:
        dtype = _INT64 if f.name == "text" else f.dtype
        column = [own.get(f.name) for own in held]  # None where deleted: not an array, so not staged
        kept = rows.get(f.name) if rows is not None and views is not None else None
        if (
            kept is not None
            and (kept.dtype == dtype or kept.dtype == f.dtype)
            and kept.shape[1:] == f.shape
            and all(map(is_, column, views[f.name]))
        ):
            arrays[f.name] = kept
            continue
        array = _copied(column, dtype, f.shape, widen=f.name == "text")
        if array is None:
            return None
        arrays[f.name] = array
    return Staged(arrays, positions)


def staged_kept(
    rows: dict[str, Any],
    slot_rows: dict[str, numpy.ndarray] | None,
    fields: list[FieldSpec],
    names: tuple[str, ...] | None,
    positions: numpy.ndarray,
) -> Staged | None:
    """:func:`staged` of kept samples (or rows changed in place: ``rows``, the micro-batch's fields). When
    they are still exactly the slot's own arrays (``slot_rows``, made by ``BatchSource.encoded`` from
    ``ring.view``: the ring's fields, in order, of their shapes and dtypes by construction), nothing is
    checked: the rows are in place; else they are checked once (:func:`_kept`)."""
    if names is not None and holds_slot(rows, slot_rows):
        return Staged(slot_rows, positions)  # type: ignore[arg-type]
    return staged([], fields, names, positions, rows, kept=True)


def holds_slot(rows: dict[str, Any], slot_rows: dict[str, numpy.ndarray] | None) -> bool:
    """Whether a micro-batch's fields ``rows`` are still exactly the slot's own arrays ``slot_rows``
    (None: the micro-batch has no slot), none replaced and none added."""
    if slot_rows is None or len(rows) != len(slot_rows):
        return False
    return all(rows.get(name) is array for name, array in slot_rows.items())


def _kept(
    rows: dict[str, numpy.ndarray],
    fields: list[FieldSpec],
    names: tuple[str, ...],
    positions: numpy.ndarray,
) -> Staged | None:
    """:func:`staged` of kept samples: ``rows`` itself, when it holds exactly the ring's fields, of
    their row shapes and dtypes (``text`` int64, or the ring's dtype)."""
    if len(rows) != len(names) or any(name not in rows for name in names):
        return None  # a field the ring does not carry, or one it carries that the samples lack
    for f in fields:
        array = rows[f.name]
        if type(array) is not numpy.ndarray:
            return None
        if array.dtype != f.dtype and not (f.name == "text" and array.dtype == _INT64):
            return None
        if array.shape != (positions.size, *f.shape):
            return None
    return Staged({f.name: rows[f.name] for f in fields}, positions)


def _fits(text: numpy.ndarray, limits: Any) -> bool:
    """Whether int64 tokens lie within ``limits`` (a numpy.iinfo): one pass for an unsigned dtype,
    as a negative token read as uint64 lies above any such limit; else min and max."""
    if not text.size:
        return True
    if limits.min == 0 and limits.max < 2**63 and text.flags.c_contiguous:
        return int(text.view(numpy.uint64).max()) <= limits.max
    return int(text.min()) >= limits.min and int(text.max()) <= limits.max


def _copied(column: list[Any], dtype: numpy.dtype, shape: tuple[int, ...], widen: bool = False) -> numpy.ndarray | None:
    """The samples' values of one field as one ``[B, *shape]`` array, or None when one is not an array
    (or numpy scalar) of that dtype and shape."""
    out = numpy.empty((len(column), *shape), dtype=dtype)
    for i, value in enumerate(column):
        if type(value) is not numpy.ndarray:
            if not isinstance(value, numpy.generic):
                return None
            value = numpy.asarray(value)
        if value.shape != shape or (value.dtype != dtype and not (widen and narrower_integers(value.dtype))):
            return None
        out[i] = value
    return out


# The ring's dtypes for fields other than text, as tensors (text arrives as int64).
TORCH_DTYPES = {
    numpy.dtype(numpy.float32): torch.float32,
    numpy.dtype(numpy.int32): torch.int32,
    numpy.dtype(numpy.int64): torch.int64,
}


def in_ring_layout(ring: Any, positions: numpy.ndarray, batch: Any) -> bool:
    """Whether a collated batch is exactly what the ring delivers: its fields (then ``sample_id``, the
    positions) as tensors of their shapes and dtypes (``text`` int64), the tokens within the ring's dtype."""
    if isinstance(batch, Staged):
        return True
    if type(batch) is not dict or list(batch) != [f.name for f in ring.fields] + ["sample_id"]:
        return False
    for field in ring.fields:
        value = batch[field.name]
        dtype = torch.int64 if field.name == "text" else TORCH_DTYPES[field.dtype]
        if not isinstance(value, torch.Tensor) or value.dtype != dtype:
            return False
        if tuple(value.shape) != (ring.batch_size, *field.shape):
            return False
    ids, text = batch["sample_id"], batch["text"]
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
        return False
    if not numpy.array_equal(ids.numpy(), positions):
        return False
    limits = numpy.iinfo(ring.dtype)
    if limits.bits == 64 and limits.min < 0:  # int64 text (an in-place encoder's ring): every token fits
        return True
    return not text.numel() or (int(text.min()) >= limits.min and int(text.max()) <= limits.max)


def write_slot(view: dict[str, numpy.ndarray], i: int, batch: Any, limits: Any) -> bool:
    """Batch ``i`` of a bundle into the slot's arrays, ``text`` narrowed into the ring's dtype (``limits``,
    a numpy.iinfo): False when a :class:`Staged` batch's token lies outside it (the slot then holds an
    undefined part of the batch). A collated batch was checked by :func:`in_ring_layout`."""
    if type(batch) is not Staged:
        for name, array in view.items():
            array[i][...] = batch[name].numpy()
        return True
    home = batch.home
    there = home[2] if home is not None and home[0] is view and home[1] == i else None
    for name, array in view.items():
        if there is not None and batch.arrays[name] is there.get(name):
            continue  # gathered into this very place, kept (or changed in place) by the encoder
        if name == "text":
            if not narrowed(batch.arrays[name], array[i], limits):
                return False
        else:
            array[i][...] = batch.arrays[name]
    return True


def narrowed(text: numpy.ndarray, out: numpy.ndarray, limits: Any) -> bool:
    """int64 ``text`` written into ``out`` (of the ring's dtype, ``limits`` its numpy.iinfo) when every
    token fits it, else False (``out`` then holds an undefined part of them): one compiled pass, or
    without the kernels numpy's range check and copy. ``text`` of ``out``'s own dtype is copied as it is."""
    if text.dtype == out.dtype:  # the ring's own dtype (a row of a slot, kept elsewhere): nothing to check
        out[...] = text
        return True
    lib = library()
    kind = _KINDS.get(out.dtype)
    if lib is not None and kind is not None and text.dtype == _INT64 and text.shape == out.shape:
        source = writable_address(text) if text.flags.c_contiguous else None
        target = writable_address(out)
        if source is not None and target is not None:
            code = lib.sf_narrow_tokens(source, text.size, target, kind)
            if code >= 0:
                return code == 0
    if not _fits(text, limits):
        return False
    out[...] = text
    return True
