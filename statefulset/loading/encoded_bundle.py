"""A worker's bundle of micro-batches through a task encoder in one call, not one call per micro-batch.

An encoder that collates (no ``batch``/``encode_batch``) and has no micro-batch path of its own
(``encode_rows_in_place``, as FillInTheMiddle's) is what the identity path of a worker runs: per
micro-batch the Python around the encoder's calls (positions, sources, row views, the loop's set-up,
staging, the slot's checks) cost more than the calls themselves. So the worker gathers each
micro-batch of a bundle into its ring slot first (``BatchSource.gathered``), then hands every
sample of the bundle to ``encode_sample`` in one ``TaskEncoderRunner.encode_rows`` call, in the
same order. When every sample came back *kept* (the very TokenSample made for it, holding the
very views of the slot's rows it was made with, and nothing added: an identity, or changes made
in place), the slot holds the bundle as the trainer receives it and nothing is staged, checked or
copied. Otherwise each micro-batch is staged or batched from its own samples as
``BatchSource.encode_gathered`` does.

The samples, their order, keys and calls are those of the per-micro-batch path, so the encoded
stream is the same; only errors are reported later (after the bundle's gathers), still naming the
micro-batch of the sample that failed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy

from statefulset.errors import StatefulsetError
from statefulset.loading.encoded_ring import holds_slot, staged
from statefulset.streams.provenance import source_prefixes


class Gathered(NamedTuple):
    """A micro-batch gathered, not yet encoded (``BatchSource.gathered``)."""

    fields: dict[str, numpy.ndarray]  # its fields: the slot's arrays unless the gather replaced one
    slot_rows: dict[str, numpy.ndarray] | None  # the slot's own arrays of its place (None: no slot)
    positions: numpy.ndarray  # its sample ids
    wrapped: numpy.ndarray  # the stream positions read (the sample ids modulo a validation wrap)


class EncodeFailed(Exception):
    """The encoder failed on a bundle's micro-batch ``t`` (``cause``: its error, which names the sample)."""

    def __init__(self, t: int, cause: StatefulsetError) -> None:
        super().__init__(t, cause)
        self.t, self.cause = t, cause


def whole_bundles(encoder: Any) -> bool:
    """Whether a worker encodes its bundles in one call each (``encoder``: a TaskEncoderRunner)."""
    return encoder.collates and not encoder.rows_in_place


def encode_bundle(
    source: Any, ring: Any, view: dict[str, numpy.ndarray], pending: list[tuple[int, Gathered]]
) -> list[tuple[int, Any]] | None:
    """``pending`` (``(t, gathered)`` of places ``0, 1, ...`` of the slot ``view`` of ``source.ring``)
    encoded: None when the slot holds them as they are to be received (every sample kept), else each
    micro-batch's ``(t, batch)`` as ``source.encode_gathered`` gives it (Staged, or the encoder's batch).
    Raises :class:`EncodeFailed` naming the micro-batch whose sample failed, or whose samples the
    collate refused."""
    batches = [g for _, g in pending]
    # Never staged, or a gather replaced a field: micro-batch by micro-batch.
    if ring.staged_names is None or not all(holds_slot(g.fields, g.slot_rows) for g in batches):
        return [(t, source.encode_gathered(g, ring, (view, i))) for i, (t, g) in enumerate(pending)]
    count, rows = len(batches), ring.batch_size
    positions = numpy.concatenate([g.positions for g in batches]) if count > 1 else batches[0].positions
    wrapped = numpy.concatenate([g.wrapped for g in batches]) if count > 1 else batches[0].wrapped
    sources = source_prefixes(source.stream, wrapped)
    # Each row's view, for the whole bundle at once: the places 0..count-1 of the slot, back to back.
    views = {name: list(array[:count].reshape(count * rows, *array.shape[2:])) for name, array in view.items()}
    try:
        samples, kept = source.encoder.encode_rows(views, positions, sources)
    except StatefulsetError as exc:  # marked with its sample (transforms.encoder.named)
        sample = getattr(exc, "sample_id", None)
        at = numpy.flatnonzero(positions == sample) if isinstance(sample, int) else ()
        raise EncodeFailed(pending[int(at[0]) // rows if len(at) else 0][0], exc) from exc
    if kept:
        return None  # the slot holds every row
    out = []
    for i, (t, batch) in enumerate(pending):
        part = slice(i * rows, (i + 1) * rows)
        mine = samples[part]
        views_i = {n: v[part] for n, v in views.items()}
        try:
            found = staged(mine, ring.fields, ring.staged_names, batch.positions, batch.fields, views_i)
            if found is not None:
                out.append((t, found.placed((view, i), batch.slot_rows)))
            else:
                out.append((t, source.encoder.batched(mine, int(batch.positions[0]))))
        except StatefulsetError as exc:  # collate's or a batch hook's refusal: this micro-batch's
            raise EncodeFailed(t, exc) from exc
    return out
