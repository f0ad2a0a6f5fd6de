"""The torchtitan 0.3 drop-in: batches, config selection, refusals, DP 4 -> 2 -> 3 through torchtitan's checkpointer.

torchtitan 0.3.0's ``Trainer`` does not run on CPU (docs/torchtitan.md says why), so the elastic
test drives torchtitan's own ``CheckpointManager`` (DCP, with its model, optimizer, LR-scheduler
and train-state entries) from a CPU loop on real gloo ranks: 4 ranks train 3 steps and save; 2
ranks (one worker process each) load it and train 4; 3 ranks load that and train 2. The whole
global token stream is then the contract's: position ``p`` of the stream, in order, with nothing
lost or repeated.
"""

from __future__ import annotations

import os

import numpy
import pytest
import torch
from ranks import init_rank, spawn

from statefulset import StatefulsetError, open_stream
from statefulset.integrations.torchtitan import IGNORE_INDEX, StatefulsetDataLoader
from statefulset.tools.demo import demo_spec

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SEQ = 16


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    return demo_spec(str(tmp_path_factory.mktemp("corpus")), documents=200, seq_length=SEQ)


def _build(config: StatefulsetDataLoader.Config, dp_world_size: int = 1, dp_rank: int = 0, batch: int = 2, **kw):
    """As torchtitan 0.3's Trainer calls it (trainer.py: ``config.dataloader.build(...)``)."""
    return config.build(
        dp_world_size=dp_world_size,
        dp_rank=dp_rank,
        tokenizer=None,
        seq_len=kw.pop("seq_len", SEQ),
        local_batch_size=batch,
        snapshot_every_n_steps=None,
        **kw,
    )


def _text(spec: str, first: int, count: int) -> torch.Tensor:
    return torch.from_numpy(open_stream(spec).gather(numpy.arange(first, first + count, dtype=numpy.int64)))


def test_batches_are_torchtitans_input_dict_and_labels(spec):
    loader = _build(StatefulsetDataLoader.Config(dataset=spec, num_workers=0, document_boundaries=False), batch=3)
    inputs, labels = next(iter(loader))
    assert sorted(inputs) == ["input", "positions"]
    assert torch.equal(inputs["positions"], torch.arange(SEQ).expand(3, SEQ))  # one document per row
    text = _text(spec, 0, 3)
    assert inputs["input"].dtype == labels.dtype == torch.int64
    assert torch.equal(inputs["input"], text[:, :-1]) and torch.equal(labels, text[:, 1:])


def test_positions_follow_documents_and_bestfit_padding_is_ignored(tmp_path):
    bestfit = demo_spec(str(tmp_path), packing="bestfit", documents=200, seq_length=64)
    config = StatefulsetDataLoader.Config(dataset=bestfit, num_workers=0)  # document_boundaries by default
    loader = _build(config, batch=4, seq_len=64)
    inputs, labels = next(iter(loader))
    sample = open_stream(bestfit).gather(numpy.arange(4, dtype=numpy.int64))
    assert sorted(inputs) == ["input", "positions"] and inputs["positions"].dtype == torch.int64
    assert (inputs["positions"][:, 0] == 0).all()  # every sample starts a document
    from statefulset import get_train_dataset

    ds = get_train_dataset(bestfit, batch_size=4, document_boundaries=True)
    for j in range(4):
        assert torch.equal(inputs["positions"][j], torch.as_tensor(ds[j]["position_ids"]))
        mask = torch.as_tensor(ds[j]["loss_mask"]) == 0
        assert torch.equal(labels[j][~mask], torch.as_tensor(sample[j][1:])[~mask])
        assert (labels[j][mask] == IGNORE_INDEX).all()
    assert (labels[3] == IGNORE_INDEX).any()  # sample 3 of this corpus ends in padding


def test_seq_len_must_match_the_specs_seq_length(spec):
    with pytest.raises(StatefulsetError, match=r"training.seq_len 32 differs from the spec's seq_length 16"):
        _build(StatefulsetDataLoader.Config(dataset=spec), seq_len=32)


def test_a_dp_size_above_one_needs_torch_distributed(spec):
    with pytest.raises(StatefulsetError, match=r"DP rank 1 of 2\): dp_world_size > 1 needs torch.distributed"):
        _build(StatefulsetDataLoader.Config(dataset=spec), dp_world_size=2, dp_rank=1)


def test_a_spec_from_config_fields_equals_the_yaml_one(spec):
    import yaml

    with open(spec) as f:
        raw = yaml.safe_load(f)
    folder = os.path.dirname(spec)
    blend = " ".join(f"{w} {os.path.join(folder, p)}" for p, w in raw["data_path"].items())
    fields = StatefulsetDataLoader.Config(data_path=blend, split=raw["split"], packing="native", num_workers=0)
    a, _ = next(iter(_build(fields)))
    b, _ = next(iter(_build(StatefulsetDataLoader.Config(dataset=spec, num_workers=0))))
    assert torch.equal(a["input"], b["input"])
    with pytest.raises(StatefulsetError, match=r"dataloader.seed given beside the spec"):
        _build(StatefulsetDataLoader.Config(dataset=spec, seed=3))
    with pytest.raises(StatefulsetError, match=r"set dataloader.dataset .* or dataloader.data_path"):
        _build(StatefulsetDataLoader.Config())
    with pytest.raises(StatefulsetError, match=r"unknown build\(\) argument\(s\): infinite"):
        _build(StatefulsetDataLoader.Config(dataset=spec), infinite=True)


def test_selected_from_torchtitans_command_line(spec):
    """torchtitan 0.3 picks a config with --module/--config and overrides fields on the command line."""
    from torchtitan.config import ConfigManager

    argv = ["--module", "statefulset.integrations.torchtitan", "--config", "statefulset_llama3_debugmodel",
            "--dataloader.dataset", spec, "--dataloader.num_workers", "0", "--dataloader.no_document_boundaries",
            "--training.seq_len", str(SEQ), "--training.local_batch_size", "2"]  # fmt: skip
    config = ConfigManager().parse_args(argv)
    assert isinstance(config.dataloader, StatefulsetDataLoader.Config)
    assert config.dataloader.dataset == spec and not config.dataloader.document_boundaries
    loader = _build(config.dataloader, seq_len=config.training.seq_len, batch=config.training.local_batch_size)
    assert sorted(next(iter(loader))[0]) == ["input", "positions"]


# -- through torchtitan's checkpointer ------------------------------------------------------------
class _TrainState:
    """The trainer's own Stateful entry (``train_state``: its step)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def _checkpointer(folder: str, dataloader, model: torch.nn.Module):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=0).build(optimizers=optimizers, training_steps=100)
    state = _TrainState()
    manager = CheckpointManager.Config(enable=True, interval=1, keep_latest_k=0).build(
        dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None, base_folder=folder,
    )  # fmt: skip
    return manager, optimizers, state


def _train(loader, manager, optimizers, state, model, steps: int) -> list[torch.Tensor]:
    """torchtitan's loop in small: draw, forward/backward, step, save at the end."""
    manager.load()
    it = iter(loader)
    seen = []
    for _ in range(steps):
        state.step += 1
        inputs, labels = next(it)
        seen.append(inputs["input"])
        loss = (model(inputs["input"].float()) - labels.float()).pow(2).mean()
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
    manager.save(state.step)
    manager.close()
    return seen


def _phase(rank, world, init_file, spec, folder, out, steps, workers) -> None:
    init_rank(rank, world, init_file)
    torch.manual_seed(0)
    model = torch.nn.Linear(SEQ, SEQ)
    loader = _build(StatefulsetDataLoader.Config(dataset=spec, num_workers=workers), world, rank)
    manager, optimizers, state = _checkpointer(folder, loader, model)
    seen = _train(loader, manager, optimizers, state, model, steps)
    torch.save(torch.stack(seen), os.path.join(out, f"rank{rank}.pt"))


def test_dp_4_then_2_then_3_continue_the_global_stream(spec, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    folder, stream, consumed = str(tmp_path / "job"), [], 0
    for world, steps, workers in ((4, 3, 0), (2, 4, 1), (3, 2, 0)):
        out = tmp_path / f"dp{world}"
        out.mkdir()
        spawn(_phase, world, tmp_path, spec, folder, str(out), steps, workers)
        seen = [torch.load(out / f"rank{r}.pt") for r in range(world)]  # [steps, B, S] each
        for t in range(steps):
            stream += [seen[r][t] for r in range(world)]  # global order: step, DP rank, row
        consumed += steps * world * 2
        if world == 4:
            keys = FileSystemReader(os.path.join(folder, "checkpoint", "step-3")).read_metadata().state_dict_metadata
            loader_keys = sorted(k for k in keys if k.startswith("dataloader."))
            assert loader_keys == ["dataloader.dp_rank_0", "dataloader.dp_rank_1", "dataloader.dp_rank_2",
                                   "dataloader.dp_rank_3", "dataloader.world_size"]  # fmt: skip
    assert torch.equal(torch.cat(stream), _text(spec, 0, consumed)[:, :-1])  # 52 samples, in order


def _save_one_rank(folder: str, loader) -> None:
    model = torch.nn.Linear(SEQ, SEQ)
    manager, optimizers, state = _checkpointer(folder, loader, model)
    _train(loader, manager, optimizers, state, model, 2)


def test_a_checkpoint_of_another_spec_is_refused_naming_the_key(spec, tmp_path):
    import yaml

    with open(spec) as f:
        raw = yaml.safe_load(f)
    other = tmp_path / "other.yaml"
    raw["data_path"] = {os.path.join(os.path.dirname(spec), p): w for p, w in raw["data_path"].items()}
    other.write_text(yaml.safe_dump({**raw, "seed": 99}))
    _save_one_rank(str(tmp_path), _build(StatefulsetDataLoader.Config(dataset=spec, num_workers=0)))
    loader = _build(StatefulsetDataLoader.Config(dataset=str(other), num_workers=0))
    manager, _, _ = _checkpointer(str(tmp_path), loader, torch.nn.Linear(SEQ, SEQ))
    with pytest.raises(StatefulsetError, match=r"load_state_dict: .*seed: state has 1234, this loader 99"):
        manager.load()


def test_torchtitans_own_loader_state_is_refused_by_name(spec, tmp_path):
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader

    class Tokens(IterableDataset):
        def __iter__(self):
            while True:
                yield {"input": torch.zeros(SEQ, dtype=torch.int64)}, torch.zeros(SEQ, dtype=torch.int64)

    theirs = ParallelAwareDataloader(Tokens(), dp_rank=0, dp_world_size=1, batch_size=2)
    _save_one_rank(str(tmp_path), theirs)
    loader = _build(StatefulsetDataLoader.Config(dataset=spec, num_workers=0))
    manager, _, _ = _checkpointer(str(tmp_path), loader, torch.nn.Linear(SEQ, SEQ))
    with pytest.raises(StatefulsetError, match=r"saved by another loader: .*torchtitan's own ParallelAwareDataloader"):
        manager.load()
    loader = _build(StatefulsetDataLoader.Config(dataset=spec, num_workers=0))
    with pytest.raises(StatefulsetError, match=r"not a statefulset torchtitan loader state \(no key 'dp_rank_0'"):
        loader.load_state_dict({"world_size": 1, "dp_rank_1": b""})


def _tensor_parallel(rank, world, init_file, spec, folders) -> None:
    """DP 2 x TP 2: global ranks 2r and 2r+1 are DP rank r. In the second job one TP peer draws a batch too many."""
    init_rank(rank, world, init_file)
    for folder, extra in zip(folders, (False, rank == 3), strict=True):
        model = torch.nn.Linear(SEQ, SEQ)
        loader = _build(StatefulsetDataLoader.Config(dataset=spec, num_workers=0), 2, rank // 2)
        manager, optimizers, state = _checkpointer(folder, loader, model)
        if extra:
            next(iter(loader))
        _train(loader, manager, optimizers, state, model, 2)


def test_tensor_parallel_peers_save_one_state_per_dp_rank_and_must_agree(spec, tmp_path):
    """A checkpoint of 4 ranks (DP 2 x TP 2) resumes in one process; peers that drew differently are refused."""
    folders = [str(tmp_path / "agree"), str(tmp_path / "disagree")]
    spawn(_tensor_parallel, 4, tmp_path, spec, folders)
    loader = _build(StatefulsetDataLoader.Config(dataset=spec, num_workers=0))
    manager, _, state = _checkpointer(folders[0], loader, torch.nn.Linear(SEQ, SEQ))
    manager.load()
    assert state.step == 2 and loader.consumed_samples == 8  # 2 steps x DP 2 x batch 2
    assert torch.equal(next(iter(loader))[0]["input"], _text(spec, 8, 2)[:, :-1])
    loader = _build(StatefulsetDataLoader.Config(dataset=spec, num_workers=0))
    manager, _, _ = _checkpointer(folders[1], loader, torch.nn.Linear(SEQ, SEQ))
    with pytest.raises(StatefulsetError, match=r"global ranks 2 and 3 \(both DP rank 1\) saved different states"):
        manager.load()
