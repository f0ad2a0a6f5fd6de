"""Which of Energon's task-encoder hooks an encoder defines, and the ones the loader refuses.

A hook counts as defined when the encoder's own class (or one of its bases outside
``megatron.energon``) defines it, or the instance holds it: the defaults of Energon's
``TaskEncoder`` / ``DefaultTaskEncoder`` do not count, so a subclass that overrides only
``encode_sample`` runs as it would under Energon.

Refused, naming the hook: what would make the stream depend on more than the position, or on a
buffer the loader does not keep (CONTRACT §15, docs/transforms.md).
"""

from __future__ import annotations

import inspect
from typing import Any

from statefulset.errors import StatefulsetError
from statefulset.transforms.keyed import unwrapped

_PACKING = (
    "packing is statefulset's own and is a pure function of the position: set `packing: bestfit` in the "
    "spec (docs/packing.md) instead of packing in the encoder"
)
REFUSED = {
    "select_samples_to_pack": _PACKING,
    "pack_selected_samples": _PACKING,
    "cook_crude_sample": "cookers decode Energon's crude webdataset samples; token samples arrive decoded",
    "preencode_sample": "it splits encoding around Energon's packing buffer, which this loader has none of: "
    "do the work in encode_sample",
    "postencode_sample": "it splits encoding around Energon's packing buffer, which this loader has none of: "
    "do the work in encode_sample",
    "batch_group_criterion": "bucketed batching would choose which samples share a micro-batch, and the "
    "layout (CONTRACT §4: row j of micro-batch t on DP rank r) would no longer be a function of the position",
}


def _energon_default(owner: type) -> bool:
    return owner.__module__.split(".")[:2] == ["megatron", "energon"]


def defined(encoder: Any, name: str) -> bool:
    """Whether the encoder defines hook ``name`` itself (not one of Energon's base-class defaults)."""
    if name in getattr(encoder, "__dict__", {}):
        return True
    for owner in type(encoder).__mro__:
        if name in vars(owner):
            return owner is not object and not _energon_default(owner)
    return False


def hook(encoder: Any, name: str) -> Any:
    """The bound hook when the encoder defines it, else None."""
    return getattr(encoder, name) if defined(encoder, name) else None


def refuse_custom_batch(encoder: Any, where: str, why: str) -> None:
    """For a caller that formats the collated batch itself (the Megatron and Nanotron builders): an
    encoder's own ``batch`` / ``encode_batch`` would replace the fields it formats."""
    if encoder is None:
        return
    for name in ("batch", "encode_batch"):
        if defined(encoder, name):
            raise StatefulsetError(
                f"{where}: task encoder {type(encoder).__qualname__} defines {name}, but {why}; keep encode_sample "
                "(its fields are collated and formatted), or build the loader with get_savable_loader directly"
            )


def refuse_hooks(encoder: Any, where: str) -> None:
    """Raise a StatefulsetError naming the first hook the loader cannot honour exactly."""
    who = f"{where}: task encoder {type(encoder).__qualname__}"
    for name, why in REFUSED.items():
        if defined(encoder, name):
            raise StatefulsetError(f"{who} defines {name}, which statefulset does not run: {why}")
    if getattr(encoder, "cookers", None):
        raise StatefulsetError(
            f"{who} registers cookers (cookers = {encoder.cookers!r}), which statefulset does not run: "
            f"{REFUSED['cook_crude_sample']}"
        )
    encode = getattr(encoder, "encode_sample", None)
    if encode is None or not callable(encode):
        raise StatefulsetError(f"{who} has no encode_sample method (Energon's name for the per-sample hook)")
    plain = getattr(encode, "__func__", encode)
    if inspect.isgeneratorfunction(unwrapped(encode)) or inspect.isgeneratorfunction(plain):
        raise StatefulsetError(
            f"{who}: encode_sample is a generator (it may yield several samples or none), which statefulset "
            "does not run: every position is one sample, so a sample's place in the stream stays a function of "
            "the position; return one sample"
        )
    for name in ("batch", "encode_batch"):
        found = hook(encoder, name)
        if found is not None and inspect.isgeneratorfunction(unwrapped(found)):
            raise StatefulsetError(f"{who}: {name} is a generator, which statefulset does not run: return one batch")
