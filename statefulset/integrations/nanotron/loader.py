"""``NanotronDataLoader``: one rank's iterator of Nanotron CLM micro-batches, its pipeline role and its state.

The input stage draws from its :class:`~statefulset.loading.loader.SavableLoader` (and sends the
raw rows down a :class:`~statefulset.parallel.transfer.StageLink`), the output stage receives them,
other stages yield ``TensorPointer``s; each formats the micro-batch with
:func:`~statefulset.integrations.nanotron.batch.clm_micro_batch`. Its state is Nanotron's
``consumed_train_samples`` plus, on the input stage, the loader's state. Built by
:func:`~statefulset.integrations.nanotron.dataloader.build_nanotron_dataloader`, whose module says
how the stages cooperate.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from statefulset.errors import StatefulsetError, check_int
from statefulset.integrations.nanotron.batch import TensorPointer, clm_micro_batch
from statefulset.loading.loader import SavableLoader
from statefulset.parallel.layout import RankInfo
from statefulset.parallel.transfer import StageLink
from statefulset.streams.label_masks import link_fields

__all__ = ["NanotronDataLoader"]


_STATE_VERSION = 1


class NanotronDataLoader:
    """One rank's endless iterator of Nanotron CLM micro-batches; build it with :func:`build_nanotron_dataloader`.

    Every rank of the job must call ``next()`` the same number of times (Nanotron's trainer does:
    ``n_micro_batches_per_batch`` per step). :attr:`consumed_train_samples` is then the value
    Nanotron keeps in its checkpoint metadata, on every rank.
    """

    def __init__(
        self,
        info: RankInfo,
        *,
        micro_batch_size: int,
        sequence_length: int,
        n_micro_batches_per_batch: int,
        consumed_train_samples: int,
        input_pp_rank: int,
        output_pp_rank: int,
        cp_size: int,
        loader: SavableLoader | None,
        link: StageLink | None,
        include_sample_id: bool,
        position_ids: bool = False,
    ) -> None:
        self.info = info
        self.micro_batch_size = micro_batch_size
        self.sequence_length = sequence_length
        self.n_micro_batches_per_batch = n_micro_batches_per_batch
        self.input_pp_rank = input_pp_rank
        self.output_pp_rank = output_pp_rank
        self.cp_size = cp_size
        self.loader = loader
        """The shard-reading loader (input stage only; None elsewhere)."""
        self.link = link
        self.include_sample_id = include_sample_id
        self.position_ids = position_ids  # DataCollatorForCLMWithPositionIds's format
        self._base = consumed_train_samples
        self._drawn = 0

    # -- roles ------------------------------------------------------------------------------------
    @property
    def pp_rank(self) -> int:
        return self.info.pp_rank

    @property
    def is_input_stage(self) -> bool:
        """This rank yields ``input_ids``/``input_mask`` tensors (and reads the shards)."""
        return self.info.pp_rank == self.input_pp_rank

    @property
    def is_output_stage(self) -> bool:
        """This rank yields ``label_ids``/``label_mask`` tensors."""
        return self.info.pp_rank == self.output_pp_rank

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over the whole job: ``micro_batch_size * n_micro_batches_per_batch * dp``."""
        return self.micro_batch_size * self.n_micro_batches_per_batch * self.info.dp_size

    @property
    def micro_batches_drawn(self) -> int:
        """``next()`` calls on this rank since it was built (or restored)."""
        return self._drawn

    @property
    def consumed_train_samples(self) -> int:
        """Nanotron's metadata integer once every rank drew as many micro-batches as this one.

        After whole steps it equals the trainer's count (``+= global batch`` per step); it is also
        exact mid-step, since micro-batch ``t`` of every DP rank covers the same global rows.
        """
        return self._base + self._drawn * self.micro_batch_size * self.info.dp_size

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> NanotronDataLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        raw: dict[str, Any] = {}
        if self.loader is not None:  # the input stage
            raw = next(self.loader)
            if self.link is not None:
                self.link.send(link_fields(raw, self.link.specs))
        elif self.link is not None:  # the output stage of a pipeline whose input stage is elsewhere
            raw = self.link.recv()
        text, sample_id = raw.get("text"), raw.get("sample_id")
        batch = clm_micro_batch(
            text,  # type: ignore[arg-type]  # None only where no tensor is built
            pp_rank=self.info.pp_rank,
            input_pp_rank=self.input_pp_rank,
            output_pp_rank=self.output_pp_rank,
            cp_rank=self.info.cp_rank,
            cp_size=self.cp_size,
            with_position_ids=self.position_ids,
            position_ids=raw.get("position_ids"),
            label_mask=raw.get("loss_mask"),
        )
        if self.include_sample_id:
            if sample_id is None:
                batch["sample_id"] = TensorPointer(group_rank=self.input_pp_rank)
            else:
                batch["sample_id"] = sample_id.clone()
        self._drawn += 1
        return batch

    def micro_batches(self) -> Iterator[dict[str, Any]]:
        """One step's draw, exactly as Nanotron's trainer makes it: a lazy generator of ``n`` micro-batches."""
        return (next(self) for _ in range(self.n_micro_batches_per_batch))

    def flush(self) -> None:
        """Wait until the output stage has received every micro-batch sent so far (input stage; else no-op).

        Call before tearing down the process group; a checkpoint does not need it.
        """
        if self.link is not None and self.is_input_stage:
            self.link.flush()

    close = flush

    def metrics(self) -> dict[str, float]:
        """The loader's ``metrics()`` on the input stage, {} on the others (docs/observability.md).

        For Nanotron's logger, in the trainer's ``train_step_logs``:
        ``log_entries += [LogItem(f"data/{k}", v, "human_format") for k, v in dl.metrics().items()]``.
        """
        return self.loader.metrics() if self.loader is not None else {}

    # -- state ------------------------------------------------------------------------------------
    def save_state_rank(self) -> dict[str, Any]:
        """This rank's state: plain data; the input stage's includes its loader state (with the data fingerprint).

        Nanotron itself only keeps ``consumed_train_samples``; this state adds the check that the
        resumed run reads the same data, seed and packing, at the cost of a fixed DP size.
        """
        return {
            "nanotron_loader": _STATE_VERSION,
            "consumed_train_samples": self.consumed_train_samples,
            "dp_size": self.info.dp_size,
            "loader": self.loader.save_state_rank() if self.loader is not None else None,
        }

    def restore_state_rank(self, state: Mapping[str, Any]) -> None:
        """Continue after the micro-batches the saving rank had drawn; call before the first ``next()``.

        A changed DP size is refused here (rank states are per DP rank); resume from
        ``consumed_train_samples`` instead, which fits any DP size.
        """
        where = f"restore_state_rank (global rank {self.info.global_rank}, pp_rank {self.info.pp_rank})"
        if self._drawn:
            raise StatefulsetError(f"{where}: this loader has already yielded micro-batches; restore into a fresh one")
        if not isinstance(state, Mapping) or state.get("nanotron_loader") != _STATE_VERSION:
            raise StatefulsetError(f"{where}: not a statefulset Nanotron loader state (version {_STATE_VERSION})")
        consumed = check_int("consumed_train_samples", state.get("consumed_train_samples"), 0, where)
        if state.get("dp_size") != self.info.dp_size:
            raise StatefulsetError(
                f"{where}: state saved with dp_size {state.get('dp_size')!r}, this job has {self.info.dp_size}; "
                "rebuild with consumed_train_samples to change the DP size"
            )
        if self.loader is not None:
            if state.get("loader") is None:
                raise StatefulsetError(f"{where}: field 'loader' is empty; this state was saved on a non-reading stage")
            self.loader.restore_state_rank(state["loader"])
            if self.loader.consumed_samples != consumed:
                raise StatefulsetError(
                    f"{where}: field 'consumed_train_samples' {consumed} disagrees with its loader state "
                    f"({self.loader.consumed_samples})"
                )
        self._base = consumed

    def state_dict(self) -> dict[str, Any]:
        """torch.distributed.checkpoint's Stateful protocol, keyed by global rank (ranks hold different states)."""
        return {f"rank_{self.info.global_rank}": self.save_state_rank()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        key = f"rank_{self.info.global_rank}"
        if not isinstance(state_dict, Mapping) or key not in state_dict:
            raise StatefulsetError(f"load_state_dict: key {key!r} is missing")
        self.restore_state_rank(state_dict[key])

    def __repr__(self) -> str:
        role = "+".join(r for r, on in (("input", self.is_input_stage), ("output", self.is_output_stage)) if on)
        return (
            f"NanotronDataLoader(rank={self.info.global_rank}, pp_rank={self.info.pp_rank}, "
            f"dp_rank={self.info.dp_rank}/{self.info.dp_size}, role={role or 'pointers'}, "
            f"consumed_train_samples={self.consumed_train_samples})"
        )
