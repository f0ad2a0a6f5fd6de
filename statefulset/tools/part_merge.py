"""The driver's half of ``--executor ray``: committed parts appended to the outputs in input order.

Parts are appended while later tasks still run, so the merge is done (all but the tail) when the
last task commits. Each part's summary is counted as it is appended: a bad line stops the run at
the first part holding one, nothing published.

Where the output is on S3 and the parts are too, the tokens never come here: only each part's
``.idx`` is downloaded (to build the merged index), and the merged ``.bin`` is assembled on the
store from the part objects by server-side copy (:mod:`statefulset.shards.object_assembly`). The
driver then needs neither the corpus's bandwidth nor its size on local disk. Elsewhere (local
outputs, other stores) each part is streamed into a local file, uploaded at the end if remote.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from statefulset.shards import idx_format, loss_masks
from statefulset.shards.object_assembly import assemble
from statefulset.shards.writer import IndexedDatasetWriter
from statefulset.tools import locations, segments
from statefulset.tools import preprocess as local
from statefulset.tools.locations import Folder, StagedOutput

logger = logging.getLogger("statefulset")
PART_PREFIX, DONE = "part-", ".done"


def part_name(number: int) -> str:
    """Task ``number``'s part: ``part-000042`` (six digits at least; a millionth task has seven)."""
    return f"{PART_PREFIX}{number:06d}"


def committed_numbers(names: list[str]) -> set[int]:
    """The task numbers of the committed parts (``part-<digits>.done``) among a parts folder's names."""
    found = set()
    for name in names:
        digits = name[len(PART_PREFIX) : -len(DONE)]
        if name.startswith(PART_PREFIX) and name.endswith(DONE) and digits.isdigit():
            found.add(int(digits))
    return found


class OrderedMerge:
    """Appends committed parts (``tasks`` in order, as :meth:`advance` learns they are committed)."""

    def __init__(self, parts: Folder, tasks: list[Any], result: Any, dtype: Any, skip_bad_lines: bool) -> None:
        self.parts, self.tasks, self.result, self.skip = parts, tasks, result, skip_bad_lines
        self.staged = {k: StagedOutput(p) for k, p in result.outputs.items()}
        self.writers = {k: IndexedDatasetWriter(o.local, dtype) for k, o in self.staged.items()}
        self.itemsize = idx_format.token_dtype(dtype).itemsize
        stores = [locations.copying_store(p) for p in (parts.path, *result.outputs.values())]
        # Parts and outputs on the same S3 endpoint: the store copies the tokens itself.
        self.on_store = all(stores) and len({id(fs) for fs, _ in stores}) == 1  # type: ignore[misc]
        self.sources: dict[str, list[tuple[str, int]]] = {k: [] for k in self.writers}
        # Mask shards: begun at the first part with one; merged here (1 byte a token) also on a store.
        self.masks = segments.MaskOutputs(result.outputs)
        self.following = 0
        self._line_of: dict[str, int] = {}

    def advance(self, committed: set[int]) -> None:
        while self.following < len(self.tasks) and self.following in committed:
            self._append(self.tasks[self.following].number)
            self.following += 1

    def _append(self, number: int) -> None:
        summary = json.loads(self.parts.read_text(part_name(number) + DONE))
        result = self.result
        for unit in summary["units"]:
            first = self._line_of.get(unit["path"], 0) + 1
            self._line_of[unit["path"]] = first - 1 + unit["lines"]
            result.blank_lines += unit["blank"]
            result.input_bytes += unit["bytes"]
            hint = f"; the committed parts in {self.parts.path} are kept for that rerun"
            local.count_bad_lines(result, unit["path"], unit["parquet"], first, unit["bad"], self.skip, hint)
        result.documents += summary["documents"]
        result.peak_task_rss = max(result.peak_task_rss, summary.get("peak_rss", 0))
        for key, writer in self.writers.items():
            result.tokens[key] = result.tokens.get(key, 0) + summary["tokens"][key]
            name = f"{part_name(number)}_{key}_document"
            self._append_mask(key, name, key in summary.get("loss_masks", ()), summary["tokens"][key])
            if not self.on_store:
                with self.parts.local_shard(name) as prefix:
                    writer.add_index(prefix)
                continue
            size = summary["tokens"][key] * self.itemsize  # the part's .bin: its tokens (no request per part)
            with self.parts.local_shard(name, (".idx",)) as prefix:
                writer.add_index_only(prefix + ".idx", size)
            self.sources[key].append((self.parts.fs_path(name + ".bin"), size))

    def _append_mask(self, key: str, name: str, has_mask: bool, tokens: int) -> None:
        """The part's mask shard, or ones shaped as its tokens once an earlier part had one; called before
        the part's tokens are appended (a new mask shard copies the shape of the tokens so far)."""
        if not has_mask and key not in self.masks.writers:
            return
        writer = self.masks.writer(key, self.writers[key])
        if has_mask:
            with self.parts.local_shard(loss_masks.mask_prefix(name)) as prefix:
                writer.add_index(prefix)
            return
        with self.parts.local_shard(name, (".idx",)) as prefix:
            writer.add_filled_index(prefix + ".idx", tokens * self.itemsize, 1)

    def publish(self) -> None:
        """Every key's output, or (when one key's upload or assembly fails) none's staging left behind."""
        try:
            self._publish()
        except BaseException:
            self.abort()
            raise

    def _publish(self) -> None:
        self.masks.publish()  # the masks before their tokens: never new tokens beside an old mask shard
        self.result.loss_masks = {k: self.masks.prefixes[k] for k in self.masks.writers}
        for key, writer in self.writers.items():
            writer.close()
            if not self.on_store:
                self.staged[key].publish()
                continue
            fs, target = locations.copying_store(self.result.outputs[key] + ".bin")  # type: ignore[misc]
            done = assemble(fs, target, self.sources[key], self.parts.fs_path(f"assembly-{key}"))
            self.staged[key].publish((".idx",))  # the index last: never one without its tokens
            self.result.store_copied += done.copied
            self.result.store_uploaded += done.uploaded
            logger.info(
                "statefulset: %s.bin assembled on the store: %d bytes copied there, %d through this machine "
                "(%s parts per upload)", self.result.outputs[key], done.copied, done.uploaded,
                "/".join(map(str, done.parts)),
            )  # fmt: skip

    def abort(self) -> None:
        self.masks.discard()
        for key, writer in self.writers.items():
            writer.abort()
            self.staged[key].discard()
