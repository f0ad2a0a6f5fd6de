"""What the store itself serves at our loader's request mix: a helper of ``bench_object_storage.py``.

The ranged GETs are the ones our loader needs for its samples 0..n in order: with ``packing:
megatron``, GPTDataset's, each sample's document pieces (from megatron-core's own sample, document
and shuffle indices over the same shard); with ``packing: native``, each sample's window of the
``.bin`` (the pieces our stream's ``explain`` names, which touch); merged per batch of ``B``
samples as our loader merges them
(:func:`statefulset.shards.remote.coalesce`). ``processes`` processes each issue the requests of
every ``processes``-th batch, keeping ``inflight`` GETs in flight (our default request limit per
process, ``STATEFULSET_STORAGE_MAX_REQUESTS``), through obstore as our loader does, for ``seconds``
from a common start time. No loader, no batches, no checks: what the store behind the proxy
answers, to set our loader's tokens/s against.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy


def sample_pieces(dataset, count: int) -> list[list[tuple[int, int]]]:
    """``(byte offset, byte size)`` of the document pieces of samples ``0..count-1`` of a GPTDataset."""
    dataset[0]  # megatron-core maps its indices lazily, on the first sample
    index = dataset.dataset.index
    pointers, lengths = index.sequence_pointers, index.sequence_lengths
    itemsize = numpy.dtype(index.dtype).itemsize
    extra = int(dataset.config.add_extra_token_to_sequence)
    out = []
    for i in range(count):
        j = int(dataset.shuffle_index[i])
        (beg, beg_off), (end, end_off) = dataset.sample_index[j], dataset.sample_index[j + 1]
        pieces = []
        for k in range(int(beg), int(end) + 1):
            doc = int(dataset.document_index[k])
            start = int(beg_off) if k == beg else 0
            stop = int(end_off) + extra if k == end else int(lengths[doc])
            pieces.append((int(pointers[doc]) + start * itemsize, (stop - start) * itemsize))
        out.append(pieces)
    return out


def explained_pieces(stream, count: int) -> list[list[tuple[int, int]]]:
    """``(byte offset, byte size)`` of the pieces of samples ``0..count-1`` of one of our streams, as
    ``stream.explain`` names them (a native sample's pieces are one window: they touch, and merge)."""
    itemsize = {d.path_prefix: numpy.dtype(d.dtype).itemsize for d in stream.shards}
    out = []
    for p in range(count):
        found = stream.explain(p)
        out.append([(pc.bin_offset * itemsize[pc.prefix], pc.tokens * itemsize[pc.prefix]) for pc in found.pieces])
    return out


def batch_requests(pieces: list[list[tuple[int, int]]], batch: int) -> list[list[tuple[int, int]]]:
    """The merged ``(start, end)`` requests of each batch, as our loader's reader merges them."""
    from statefulset.shards.remote import coalesce

    out = []
    for b in range(0, len(pieces) - batch + 1, batch):
        flat = [p for sample in pieces[b : b + batch] for p in sample]
        out.append(coalesce([o for o, _ in flat], [s for _, s in flat])[0])
    return out


async def _loop(store, key: str, requests: list[tuple[int, int]], inflight: int, start_at: float, seconds: float):
    import obstore

    done = [0, 0]  # requests, bytes answered inside the window
    position = [0]
    begin, stop = max(start_at, time.time()), start_at + seconds  # a late start shortens the window

    async def worker() -> None:
        while time.time() < stop:
            lo, hi = requests[position[0] % len(requests)]
            position[0] += 1
            data = await obstore.get_range_async(store, key, start=lo, end=hi)
            if begin <= time.time() <= stop:
                done[0] += 1
                done[1] += len(data)

    await asyncio.sleep(max(0.0, start_at - time.time()))
    cpu = time.process_time()
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(inflight))), seconds + 120)
    return done, stop - begin, time.process_time() - cpu


def run_capacity(job: dict) -> dict:
    """One of ``job['processes']`` processes of the loop (the parent sums them)."""
    from obstore.store import S3Store

    requests = [r for i, batch in enumerate(job["batches"]) if i % job["processes"] == job["index"] for r in batch]
    bucket, key = job["prefix"][len("s3://") :].split("/", 1)
    store = S3Store(
        bucket, endpoint=os.environ["AWS_ENDPOINT_URL"], access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"], region="us-east-1",
        client_options={"allow_http": True},
    )  # fmt: skip
    loop = _loop(store, key + ".bin", requests, job["inflight"], job["start_at"], job["seconds"])
    done, window, cpu = asyncio.run(loop)
    return {"requests": done[0], "bytes": done[1], "seconds": window, "cpu_s": cpu}
