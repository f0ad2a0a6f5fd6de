"""The dataset spec: a YAML file (or the same mapping as a dict), validated with pydantic.

Every mistake is a ``StatefulsetError`` naming the key and the file.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, field_validator, model_validator

from statefulset.errors import StatefulsetError
from statefulset.spec.splits import SPLITS, parse_split
from statefulset.spec.stages import StageSpec, check_stages, parse_stage_blends, union_of

# (prefix, weight); the weight is None when none was given (one prefix, or a list of prefixes):
# Megatron then builds a lone GPTDataset, or blends by dataset size, not by weight.
Blend = list[tuple[str, float | None]]

# What a spec built without load_spec (``DatasetSpec(...)``) is called in messages.
_UNNAMED = "spec"
_INT32_MAX = 2**31 - 1
# numpy.random.RandomState, which megatron-core seeds with the spec's seed, takes [0, 2**32).
_MEGATRON_SEED_MAX = 2**32 - 1
# Types pydantic's strict mode checks, by error type: what the message asks for instead.
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "dict_type": "a mapping",
    "model_type": "a mapping",
}


def _blend(value: Any) -> Blend:
    """One prefix, a mapping prefix → weight (Nanotron), ``[w1, p1, w2, p2, ...]`` or ``[p1, p2, ...]`` (Megatron)."""
    if isinstance(value, str):
        return [_unweighted(value)]
    if isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value):
        return [_unweighted(v) for v in value]
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, list | tuple):
        if len(value) % 2 or not value:
            raise ValueError("a list must alternate weights and prefixes: [w1, prefix1, w2, prefix2, ...]")
        else:
            pairs = [(value[i + 1], value[i]) for i in range(0, len(value), 2)]
    else:
        raise ValueError(f"expected a prefix, a mapping prefix -> weight or a list, got {type(value).__name__}")
    out: Blend = []
    for prefix, weight in pairs:
        if not isinstance(prefix, str):
            raise ValueError(f"prefix {prefix!r} ({type(prefix).__name__}) is not a string; quote it in YAML")
        if not prefix:
            raise ValueError("a prefix is an empty string")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"weight of {prefix!r} is {weight!r}, not a number")
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weight of {prefix!r} is {weight}; weights must be finite and non-negative")
        out.append((prefix, float(weight)))
    if sum(w for _, w in out) <= 0:
        raise ValueError("all weights are zero")
    return out


def _unweighted(prefix: str) -> tuple[str, None]:
    if not prefix:
        raise ValueError("a prefix is an empty string")
    return (prefix, None)


def _positive_or_none(v: int | None) -> int | None:
    if v is not None and v <= 0:
        raise ValueError(f"must be positive, got {v}")
    return v


class SplitSpec(BaseModel):
    """Data for one split when splits come from separate prefixes (Megatron's blend_per_split)."""

    # strict: '512' is not a number and true is not 1, in a spec as in Megatron's argparse.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    data_path: Blend
    num_samples: int | None = None

    _blend = field_validator("data_path", mode="before")(_blend)

    _num_samples = field_validator("num_samples")(_positive_or_none)


class DatasetSpec(BaseModel):
    """What to load; see docs/yaml.md for every key.

    ``source`` names where the spec came from (its YAML file, or ``spec (dict)``); every error
    about the spec, also those raised later while a stream opens, starts with it. It is no part
    of the spec's value: two specs with the same keys are equal wherever they came from.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    data_path: Blend | None = None
    seq_length: int
    split: str = "969,30,1"
    seed: int = 1234
    packing: Literal["megatron", "native", "bestfit"] = "megatron"
    # packing bestfit: the token id of padding (-1 when unset); never a token id of the shards.
    pad_id: int | None = None
    num_samples: int | None = None
    path_to_cache: str | None = None
    # Handed to fsspec for every URL of the spec (endpoint_url, profile, key/secret, client_kwargs ...).
    storage_options: dict[str, Any] | None = None
    train: SplitSpec | None = None
    valid: SplitSpec | None = None
    test: SplitSpec | None = None
    # A data schedule (docs/schedules.md): replaces data_path for packing native and bestfit.
    stages: list[StageSpec] | None = None
    _source: str = PrivateAttr(default=_UNNAMED)

    _blend = field_validator("data_path", mode="before")(lambda v: None if v is None else _blend(v))

    @field_validator("seq_length")
    @classmethod
    def _seq_length(cls, v: int) -> int:
        if not 2 <= v <= _INT32_MAX:
            raise ValueError(f"must be at least 2 and at most {_INT32_MAX}, got {v}")
        return v

    _num_samples = field_validator("num_samples")(_positive_or_none)

    @field_validator("split", mode="before")
    @classmethod
    def _split(cls, v: Any) -> str:
        if isinstance(v, list | tuple):
            v = ",".join(str(x) for x in v)
        if not isinstance(v, str | int | float):
            raise ValueError(f"expected a string like '949,50,1', got {type(v).__name__}")
        try:
            parse_split(str(v))
        except StatefulsetError as exc:
            raise ValueError(str(exc)) from None
        return str(v)

    @model_validator(mode="after")
    def _some_data(self) -> DatasetSpec:
        per_split = any(getattr(self, s) is not None for s in SPLITS)
        if self.stages is not None:
            if self.data_path is not None or per_split:
                raise ValueError("key 'stages': give stages instead of data_path (and of train:/valid:/test:)")
            problem = check_stages(self.stages, self.packing, _blend)
            if problem is not None:
                raise ValueError(problem)
            parsed = parse_stage_blends(self.stages, _blend)
            stages = [
                stage.model_copy(update={"data_path": blend}) for stage, blend in zip(self.stages, parsed, strict=True)
            ]
            object.__setattr__(self, "stages", stages)
            return self
        if self.data_path is None and not per_split:
            raise ValueError("give data_path, per-split train:/valid:/test: sections, or stages")
        if self.data_path is not None and per_split:
            raise ValueError("give either data_path (with split) or train:/valid:/test:, not both")
        if self.pad_id is not None and self.packing != "bestfit":
            raise ValueError(f"key 'pad_id': only packing bestfit pads samples; this spec has packing {self.packing}")
        if self.packing == "megatron" and not 0 <= self.seed <= _MEGATRON_SEED_MAX:
            # Checked here: numpy would raise a bare ValueError deep inside the index build.
            raise ValueError(
                f"key 'seed': packing megatron seeds numpy's RandomState, which takes 0 to 2**32-1; got {self.seed}"
            )
        return self

    # -- naming the spec in errors --------------------------------------------------------------
    @property
    def source(self) -> str:
        """The YAML file this spec was read from, ``spec (dict)`` for a mapping, else ``spec``."""
        return self._source

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DatasetSpec):
            return NotImplemented
        return self.model_dump() == other.model_dump()  # pydantic's own __eq__ would compare the source too

    def error(self, key: str, message: str) -> StatefulsetError:
        """A ``StatefulsetError`` about ``key`` of this spec, naming the spec's file."""
        return StatefulsetError(f"{self._source}: key '{key}': {message}")

    @contextlib.contextmanager
    def blame(self, key: str) -> Iterator[None]:
        """Re-raise a ``StatefulsetError`` from the block (same class) as an error about ``key``,
        unless it already names this spec (an inner block knew better)."""
        try:
            yield
        except StatefulsetError as exc:
            if str(exc).startswith(f"{self._source}: "):
                raise
            raise type(exc)(f"{self._source}: key '{key}': {exc}") from exc

    def data_key(self, split: str) -> str:
        """The key whose prefixes feed ``split``: ``data_path``, ``stages`` or ``<split>.data_path``."""
        if self.stages is not None:
            return "stages"
        return "data_path" if self.data_path is not None else f"{split}.data_path"

    def num_samples_key(self, split: str) -> str:
        """The key that sets ``split``'s num_samples: ``<split>.num_samples`` when that section sets it."""
        section = getattr(self, split)
        return f"{split}.num_samples" if section is not None and section.num_samples is not None else "num_samples"

    def stage_blends(self) -> list[tuple[int, Blend]]:
        """``(start, blend)`` of every stage; a plain ``data_path`` is the one stage ``(0, data_path)``
        (CONTRACT §12). A weight of None means "by size" (one prefix alone: all of it)."""
        if self.stages is None:
            return [(0, list(self.data_path))] if self.data_path is not None else []
        return [(stage.start, list(stage.data_path)) for stage in self.stages]

    def blend_for(self, split: str) -> tuple[Blend, int | None] | None:
        """(prefixes with weights, num_samples) for a split, or None when the split is empty.

        With stages: every prefix any stage names, unweighted (the train stream then follows the
        stages; valid and test blend those sources by size).
        """
        if self.stages is not None:
            if parse_split(self.split)[SPLITS.index(split)] == 0:
                return None
            return union_of([blend for _, blend in self.stage_blends()]), None
        if self.data_path is not None:
            ratios = parse_split(self.split)
            if ratios[SPLITS.index(split)] == 0:
                return None
            return self.data_path, (self.num_samples if split == "train" else None)
        section = getattr(self, split)
        if section is None:
            return None
        num_samples = section.num_samples
        if split == "train" and num_samples is None:
            num_samples = self.num_samples
        return section.data_path, num_samples


def _resolve(prefix: str, base: str | None) -> str:
    if "://" in prefix or os.path.isabs(prefix) or base is None:
        return prefix
    return os.path.normpath(os.path.join(base, prefix))


def load_spec(source: str | os.PathLike[str] | Mapping[str, Any], *, check_files: bool = True) -> DatasetSpec:
    """Read and validate a spec; relative prefixes resolve against the YAML file's folder."""
    if isinstance(source, Mapping):
        where, base, raw = "spec (dict)", os.getcwd(), dict(source)
    else:
        where = os.fspath(source)
        base = os.path.dirname(os.path.abspath(where))
        try:
            with open(where, encoding="utf-8") as f:
                raw = yaml.safe_load(f)
        except FileNotFoundError:
            raise StatefulsetError(f"{where}: no such spec file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise StatefulsetError(f"{where}: cannot read: {exc}") from exc
        except yaml.YAMLError as exc:
            raise StatefulsetError(f"{where}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise StatefulsetError(f"{where}: the spec must be a mapping of keys, got {type(raw).__name__}")
    try:
        spec = DatasetSpec.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            key = ".".join(str(p) for p in error["loc"]).replace("stages.", "stages[", 1)
            if key.startswith("stages[") and "." in key:
                key = key.replace(".", "].", 1)  # stages[0].start, as the checks name it
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] == "extra_forbidden":
                message = "unknown key"
            elif error["type"] in _EXPECTED:
                value = error["input"]
                message = f"must be {_EXPECTED[error['type']]}, got {value!r} ({type(value).__name__})"
            if message.startswith("key '"):
                key = ""  # a check across keys that names its key itself
            problems.append(f"key '{key}': {message}" if key else message)
        raise StatefulsetError(f"{where}: " + "; ".join(problems)) from None
    updates: dict[str, Any] = {}
    if spec.data_path is not None:
        updates["data_path"] = [(_resolve(p, base), w) for p, w in spec.data_path]
    for split in SPLITS:
        section = getattr(spec, split)
        if section is not None:
            updates[split] = section.model_copy(
                update={"data_path": [(_resolve(p, base), w) for p, w in section.data_path]}
            )
    if spec.stages is not None:
        updates["stages"] = [
            stage.model_copy(update={"data_path": [(_resolve(p, base), w) for p, w in stage.data_path]})
            for stage in spec.stages
        ]
    if spec.path_to_cache is not None:
        updates["path_to_cache"] = _resolve(spec.path_to_cache, base)
    spec = spec.model_copy(update=updates)
    spec._source = where
    if check_files:
        _check_shards(spec)
    return spec


def _check_shards(spec: DatasetSpec) -> None:
    sections = [("data_path", spec.data_path)] + [
        (f"{s}.data_path", getattr(spec, s).data_path) for s in SPLITS if getattr(spec, s) is not None
    ]
    sections += [(f"stages[{k}].data_path", stage.data_path) for k, stage in enumerate(spec.stages or [])]
    checked: set[str] = set()  # a schedule names its sources in many stages: look once
    for key, blend in sections:
        for prefix, _ in blend or []:
            if prefix in checked:
                continue
            checked.add(prefix)
            for ext in (".bin", ".idx"):
                if not _exists(prefix + ext):
                    raise spec.error(key, f"shard {prefix}{ext} does not exist")


def _exists(path: str) -> bool:
    # Object-storage URLs are checked when the stream opens them, where a missing object, a
    # missing fsspec backend, refused credentials and an unreachable endpoint each get their own
    # message (statefulset.shards.remote); asking here would cost requests and say less.
    return "://" in path or os.path.exists(path)
