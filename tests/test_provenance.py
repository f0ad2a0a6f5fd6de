"""ds.explain(p): the pieces it names, read back from the shards, are exactly ds[p]["text"]."""

from __future__ import annotations

import numpy
import pytest

from statefulset import IndexedDataset, IndexedDatasetWriter, get_train_dataset, get_val_dataset
from statefulset.errors import SequenceIndexError, StatefulsetError
from statefulset.tokenization import ByteTokenizer

EOD = 256


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three shards of printable bytes + EOD, with multi-sequence documents and empty sequences."""
    root = tmp_path_factory.mktemp("provenance")
    rng = numpy.random.default_rng(10)
    prefixes = []
    for k, documents in enumerate((90, 40, 150)):
        prefix = str(root / f"part_{k}")
        with IndexedDatasetWriter(prefix, numpy.uint16) as writer:
            for _ in range(documents):
                lengths = [int(x) for x in rng.integers(0, 30, int(rng.integers(1, 4)))]
                tokens = rng.integers(32, 127, sum(lengths))
                lengths[-1] += 1
                writer.add_document(numpy.append(tokens, EOD), lengths)
        prefixes.append(prefix)
    return prefixes


def rebuilt(found) -> numpy.ndarray:
    """The sample as its pieces say: each run read from its shard, twice (by .bin offset and by sequence)."""
    parts = []
    for piece in found.pieces:
        shard = IndexedDataset(piece.prefix)
        run = piece.read(shard)
        numpy.testing.assert_array_equal(run, shard.get(piece.sequence, piece.offset, piece.tokens))
        first, last = shard.document_indices[piece.document], shard.document_indices[piece.document + 1]
        assert first <= piece.sequence < last
        assert piece.tokens > 0 and piece.offset + piece.tokens <= piece.sequence_tokens
        assert piece.sequence_tokens == shard.sequence_lengths[piece.sequence]
        parts.append(run)
    return numpy.concatenate(parts).astype(numpy.int64)


def check(ds, positions) -> list:
    found = []
    for p in positions:
        explained = ds.explain(p)
        numpy.testing.assert_array_equal(rebuilt(explained), ds[p]["text"])
        assert explained.position == p and explained.tokens == ds.stream.seq_length + 1
        assert explained.split == ds.split and all(pc.prefix == explained.source for pc in explained.pieces)
        found.append(explained)
    return found


def specs(shards):
    one, blend = shards[0], {shards[0]: 0.5, shards[1]: 0.2, shards[2]: 0.3}
    return {
        "megatron": {"data_path": one, "seq_length": 24, "split": "90,10,0"},
        "megatron_epochs": {"data_path": one, "seq_length": 24, "split": "90,10,0", "num_samples": 400},
        "megatron_blend": {"data_path": blend, "seq_length": 16, "split": "90,10,0", "num_samples": 300},
        "megatron_by_size": {"data_path": shards, "seq_length": 16, "split": "90,10,0"},
        "native": {"data_path": one, "seq_length": 24, "split": "90,10,0", "packing": "native"},
        "native_blend": {"data_path": blend, "seq_length": 16, "split": "90,10,0", "packing": "native"},
    }


@pytest.mark.parametrize("name", ["megatron", "megatron_epochs", "megatron_blend", "megatron_by_size"])
def test_megatron_pieces_rebuild_every_sample_and_the_wrap(shards, name):
    ds = get_train_dataset(specs(shards)[name], batch_size=2)
    n = len(ds.stream)
    found = check(ds, range(n))
    check(ds, [n, n + 7, 3 * n + 5])  # the repeating loader reads p % len(stream)
    wrapped = ds.explain(3 * n + 5)
    assert (wrapped.read_position, wrapped.wrap) == (5, 3)
    assert wrapped.pieces == found[5].pieces and wrapped.source == found[5].source
    assert ds.explain(5).wrap == 0 and ds.explain(5).read_position == 5
    if name == "megatron_epochs":  # num_samples beyond one epoch: the index holds several
        assert {f.epoch for f in found} == set(range(max(f.epoch for f in found) + 1)) and found[0].epoch >= 0
        assert max(f.epoch for f in found) >= 2
    if name == "megatron_blend":
        sources = [f.source_index for f in found]
        assert sources == ds.stream.blend["dataset_index"].tolist()
        assert [f.local_sample for f in found] == ds.stream.blend["dataset_sample_index"].tolist()
        assert {f.source for f in found} == set(shards)


@pytest.mark.parametrize("name", ["native", "native_blend"])
def test_native_pieces_rebuild_samples_in_any_epoch(shards, name):
    ds = get_train_dataset(specs(shards)[name], batch_size=2)
    rng = numpy.random.default_rng(0)
    positions = [*range(200), *rng.integers(0, 10**6, 100).tolist(), 10**12 + 3]
    found = check(ds, positions)
    for f in found:
        windows = ds.stream.sources[f.source_index].windows
        assert f.epoch == f.local_sample // windows and f.wrap == 0 and f.read_position == f.position
    assert max(f.epoch for f in found) > 10
    if name == "native_blend":
        which, local = ds.stream.schedule.locate(numpy.array(positions))
        assert [f.source_index for f in found] == which.tolist()
        assert [f.local_sample for f in found] == local.tolist()


@pytest.mark.parametrize("packing", ["megatron", "native"])
def test_valid_split_is_explained_and_bounded(shards, packing):
    spec = {**specs(shards)["megatron_blend" if packing == "megatron" else "native_blend"], "packing": packing}
    ds = get_val_dataset(spec, batch_size=1)
    found = check(ds, range(min(len(ds.stream), 120)))
    assert {f.split for f in found} == {"valid"}
    for f in found:  # every piece lies in the valid range of its shard (after 90% of the sequences)
        shard = IndexedDataset(f.source)
        assert all(pc.sequence >= round(0.9 * len(shard)) for pc in f.pieces)
    if packing == "megatron":
        with pytest.raises(SequenceIndexError, match="outside"):
            ds.explain(len(ds.stream))  # no repeat on the valid split: past the end is an error


def test_decoded_text_of_the_pieces(shards):
    ds = get_train_dataset(specs(shards)["native_blend"], batch_size=1)
    tok = ByteTokenizer()
    for p in (0, 1, 77, 5000):
        plain, decoded = ds.explain(p), ds.explain(p, tokenizer="bytes")
        assert all(pc.text is None for pc in plain.pieces)
        assert [pc.text for pc in decoded.pieces] == [
            tok.decode(pc.read(IndexedDataset(pc.prefix))) for pc in plain.pieces
        ]
        assert "".join(pc.text for pc in decoded.pieces) == tok.decode(ds[p]["text"])
        block = decoded.text()
        assert block.startswith(f"sample {p} (train, packing native, 17 tokens)")
        assert repr(decoded.pieces[0].text) in block and plain.source in block
    assert ds.explain(3, tokenizer=tok) == ds.explain(3, tokenizer="bytes")


def test_plain_data_and_errors(shards):
    ds = get_train_dataset(specs(shards)["megatron_blend"], batch_size=1)
    found = ds.explain(4).as_dict()
    keys = {"split", "packing", "seq_length", "position", "read_position", "wrap", "source", "source_index"}
    assert keys | {"local_sample", "epoch", "pieces"} == set(found)
    piece_keys = {"prefix", "sequence", "document", "offset", "tokens", "bin_offset", "sequence_tokens", "text"}
    assert set(found["pieces"][0]) == piece_keys
    with pytest.raises(SequenceIndexError):
        ds.explain(-1)
    with pytest.raises(TypeError):
        ds.explain(1.5)
    with pytest.raises(StatefulsetError, match="tokenizer"):
        ds.explain(1, tokenizer=3)
    with pytest.raises(StatefulsetError, match="no such tokenizer"):
        ds.explain(1, tokenizer="/nonexistent/tokenizer.json")
