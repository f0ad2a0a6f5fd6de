"""Stock Megatron-LM arguments: the --dataloader-save flag it reads but never defines, layouts, resume states."""

from __future__ import annotations

import argparse
import logging

import pytest

from statefulset import ParallelLayout, StatefulsetError
from statefulset.integrations.megatron.state_files import (
    add_statefulset_args,
    layout_from_megatron_args,
    load_megatron_dataloader_state_from_args,
    megatron_dataloader_state_path,
    save_megatron_dataloader_state,
)


class Saved:
    """What maybe_save_dataloader_state sees: ``train_iterator.iterable.save_state()``."""

    def __init__(self, state):
        self.state = state

    def save_state(self):
        return self.state


def _state(dp_rank=0, dp_size=2, batches=7):
    identity = {
        "packing": "native",
        "split": "train",
        "split_ratios": "98,2,0",
        "seq_length": 8,
        "seed": 1,
        "num_samples": None,
        "data": "0" * 24,
    }
    return {
        "format": "statefulset.loader",
        "version": 1,
        "identity": identity,
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "batch_size": 2,
        "base": 0,
        "batches": batches,
        "num_workers": 1,
    }


def _args(**values):
    """A namespace shaped like Megatron-LM's get_args() (only what the helpers read)."""
    base = {"world_size": 4, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    return argparse.Namespace(**{**base, **values})


def test_extra_args_provider_adds_the_flag_stock_megatron_reads():
    parser = add_statefulset_args(argparse.ArgumentParser())
    args = parser.parse_args(["--dataloader-save", "ckpt", "--statefulset-spec", "dataset.yaml"])
    assert args.dataloader_save == "ckpt" and args.statefulset_spec == "dataset.yaml"
    assert parser.parse_args([]).dataloader_save is None


def test_extra_args_provider_chains_after_one_that_already_adds_the_flag():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataloader-save", type=str, default=None)  # as Megatron-LM's multimodal args do
    args = add_statefulset_args(parser).parse_args(["--dataloader-save", "d"])
    assert args.dataloader_save == "d"


def test_layout_from_args_picks_megatrons_order():
    layout = layout_from_megatron_args(_args(world_size=8, pipeline_model_parallel_size=2))
    assert (layout.tp, layout.pp, layout.dp, layout.order) == (2, 2, 2, "tp-cp-ep-dp-pp")
    mapped = layout_from_megatron_args(_args(world_size=8, pipeline_model_parallel_size=2, use_tp_pp_dp_mapping=True))
    assert mapped.order == "tp-cp-ep-pp-dp" and mapped.rank_info(2).pp_rank == 1
    with pytest.raises(StatefulsetError, match="no world_size"):
        layout_from_megatron_args(argparse.Namespace())


def test_stock_args_without_the_flag_warn_instead_of_attribute_error(caplog):
    layout = layout_from_megatron_args(_args())
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        assert load_megatron_dataloader_state_from_args(_args(iteration=10), layout, rank=0) is None
    assert "will save no loader state" in caplog.text and "--dataloader-save" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        load_megatron_dataloader_state_from_args(_args(iteration=10), layout, rank=1)
    assert not caplog.text  # said once, by global rank 0


def test_a_non_external_dataloader_type_is_refused():
    layout = layout_from_megatron_args(_args())
    with pytest.raises(StatefulsetError, match="--dataloader-type external"):
        load_megatron_dataloader_state_from_args(_args(dataloader_type="single"), layout, rank=0)


def test_resume_reads_what_save_checkpoint_wrote(tmp_path, caplog):
    args = _args(
        world_size=8, pipeline_model_parallel_size=2, dataloader_save=str(tmp_path), dataloader_type="external"
    )
    layout = layout_from_megatron_args(args)
    for dp_rank in range(layout.dp):
        save_megatron_dataloader_state(Saved(_state(dp_rank)), tmp_path, 30, dp_rank, pipeline_parallel=True)
    assert load_megatron_dataloader_state_from_args(argparse.Namespace(**vars(args), iteration=0), layout, 0) is None
    args.iteration = 30
    for rank in range(layout.world_size):
        info = layout.rank_info(rank)
        got = load_megatron_dataloader_state_from_args(args, layout, rank)
        assert got == (_state(info.dp_rank) if info.loads_data else None), rank
    (tmp_path / "iter_0000030" / "mp_rank_00_000" / "train_dataloader_dprank001.pt").unlink()
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        assert load_megatron_dataloader_state_from_args(args, layout, layout.rank_info(2).global_rank) is None
    assert "train_dataloader_dprank001.pt does not exist" in caplog.text


@pytest.mark.parametrize("layout", [ParallelLayout(8, tp=2, ep=2), ParallelLayout(16, tp=2, cp=2, ep=2)])
def test_resume_finds_the_expert_suffixed_name_of_core_v0_16(tmp_path, layout):
    # core_v0.16 to 0.18 add the saving rank's expert rank to the folder name; CP peers of a saver have
    # another expert rank of their own, so the name must come from the saver's.
    args = _args(world_size=layout.world_size, dataloader_save=str(tmp_path), iteration=5)
    for rank in range(layout.world_size):
        info = layout.rank_info(rank)
        if info.saves_state:
            state = Saved(_state(info.dp_rank, layout.dp))
            path = save_megatron_dataloader_state(
                state, tmp_path, 5, info.dp_rank, pipeline_parallel=False, expert_rank=info.ep_rank
            )
            assert path == megatron_dataloader_state_path(
                tmp_path, 5, info.dp_rank, pipeline_parallel=False, expert_rank=info.ep_rank
            )
    for rank in range(layout.world_size):
        expected = _state(layout.rank_info(rank).dp_rank, layout.dp)
        assert load_megatron_dataloader_state_from_args(args, layout, rank) == expected, rank
