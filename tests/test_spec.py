"""The YAML dataset spec: the three data_path forms, per-split sections, and errors naming key and file."""

from __future__ import annotations

import contextlib

import numpy
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from statefulset import IndexedDatasetWriter, StatefulsetError
from statefulset.spec.model import load_spec


@pytest.fixture
def shards(tmp_path):
    for name in ("a", "b"):
        with IndexedDatasetWriter(tmp_path / "data" / name) as w:
            w.add_document(numpy.arange(100) % 7)
    return tmp_path


def write_yaml(folder, content) -> str:
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(content) if isinstance(content, dict) else content)
    return str(path)


def test_three_forms_of_data_path_and_relative_paths(shards):
    root = shards / "data"
    one = load_spec(write_yaml(shards, {"data_path": "data/a", "seq_length": 16}))
    assert one.data_path == [(str(root / "a"), None)]
    nanotron = load_spec(write_yaml(shards, {"data_path": {"data/a": 0.7, "data/b": 0.3}, "seq_length": 16}))
    megatron = load_spec(write_yaml(shards, {"data_path": [0.7, "data/a", 0.3, "data/b"], "seq_length": 16}))
    assert nanotron.data_path == megatron.data_path == [(str(root / "a"), 0.7), (str(root / "b"), 0.3)]
    as_dict = load_spec({"data_path": str(root / "a"), "seq_length": 16, "packing": "native"})
    assert as_dict.packing == "native" and as_dict.blend_for("test") == ([(str(root / "a"), None)], None)


def test_per_split_sections(shards):
    spec = load_spec(
        write_yaml(
            shards,
            {
                "seq_length": 8,
                "num_samples": 50,
                "train": {"data_path": {"data/a": 1, "data/b": 3}},
                "valid": {"data_path": "data/b"},
            },
        )
    )
    blend, num_samples = spec.blend_for("train")
    assert [w for _, w in blend] == [1.0, 3.0] and num_samples == 50
    assert spec.blend_for("valid")[1] is None
    assert spec.blend_for("test") is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"data_path": "data/a", "seq_length": 16, "shuffle": True}, r"key 'shuffle': unknown key"),
        ({"data_path": "data/a", "seq_length": 1}, r"key 'seq_length': must be at least 2"),
        ({"data_path": "data/a", "seq_length": 0}, r"key 'seq_length'"),
        ({"data_path": {"data/a": -1}, "seq_length": 8}, r"key 'data_path': weight of 'data/a' is -1"),
        ({"data_path": {"data/a": 0, "data/b": 0}, "seq_length": 8}, r"key 'data_path': all weights are zero"),
        ({"data_path": [1, "data/a", 2], "seq_length": 8}, r"key 'data_path': a list must alternate"),
        ("data_path: {1: 0.5}\nseq_length: 8\n", r"key 'data_path': prefix 1 \(int\) is not a string; quote it"),
        ({"data_path": {"": 1}, "seq_length": 8}, r"key 'data_path': a prefix is an empty string"),
        ({"data_path": "data/a", "seq_length": "512"}, r"key 'seq_length': must be an integer, got '512' \(str\)"),
        ({"data_path": "data/a", "seq_length": 8, "seed": True}, r"key 'seed': must be an integer, got True"),
        ({"data_path": "data/a", "seq_length": 8, "split": "90,x"}, r"key 'split'"),
        ({"data_path": "data/a", "seq_length": 8, "split": "1,-1"}, r"key 'split': .*negative"),
        ({"data_path": "data/a", "seq_length": 8, "split": "0,0"}, r"key 'split': .*positive total"),
        ({"data_path": "data/missing", "seq_length": 8}, r"key 'data_path': shard .*missing\.bin does not exist"),
        ({"data_path": "data/a", "seq_length": 8, "packing": "nanotron"}, r"key 'packing'"),
        ({"data_path": "data/a", "seq_length": 8, "num_samples": -5}, r"key 'num_samples': must be positive"),
        ({"seq_length": 8}, r"give data_path, per-split train:/valid:/test: sections, or stages"),
        ({"seq_length": 8, "train": {"data_path": "data/a", "extra": 1}}, r"key 'train.extra': unknown key"),
        ("- just\n- a list\n", r"must be a mapping"),
        ("data_path: [unclosed\n", r"not valid YAML"),
    ],
)
def test_mistakes_name_key_and_file(shards, content, message):
    path = write_yaml(shards, content)
    with pytest.raises(StatefulsetError, match=rf"spec\.yaml: .*{message}"):
        load_spec(path)


def test_missing_spec_file(tmp_path):
    with pytest.raises(StatefulsetError, match=r"nope\.yaml: no such spec file"):
        load_spec(tmp_path / "nope.yaml")


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
keys = st.sampled_from(["data_path", "seq_length", "split", "seed", "packing", "num_samples", "train", "zzz"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, values, max_size=6))
def test_fuzz_specs_fail_only_with_statefulset_error(spec):
    with contextlib.suppress(StatefulsetError):
        load_spec(spec, check_files=False)


def test_list_of_prefixes_is_unweighted(shards):
    spec = load_spec(write_yaml(shards, {"data_path": ["data/a", "data/b"], "seq_length": 8}))
    assert [w for _, w in spec.data_path] == [None, None]
