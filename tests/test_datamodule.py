"""StatefulsetDataModule under a real Lightning Trainer on CPU: resume continues the uninterrupted run exactly.

Every check compares whole ordered lists of sample ids: the uninterrupted run against the
contract's layout ``(t*W + r)*B + j``, and a resumed run against the uninterrupted run's tail.
Validation passes are compared whole too: each starts at the split's first sample.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from statefulset import StatefulsetError  # noqa: E402
from statefulset.integrations.lightning.datamodule import StatefulsetDataModule  # noqa: E402
from statefulset.integrations.lightning.stage_loaders import TrainStageLoader  # noqa: E402
from statefulset.tools.demo import demo_spec  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

B = 4  # micro-batch size
VAL_BATCHES = 2


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    return demo_spec(str(tmp_path_factory.mktemp("corpus")), documents=600, seq_length=32, split="90,5,5")


class Recorder(L.LightningModule):
    """A tiny model that writes the sample ids of every training and validation batch it sees to a file."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.emb = torch.nn.Embedding(257, 4)
        self.head = torch.nn.Linear(4, 257)
        self.train_ids: list[list[int]] = []
        self.val_passes: list[list[list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.train_ids.append(batch["sample_id"].tolist())
        x, y = batch["text"][:, :-1], batch["text"][:, 1:]
        return torch.nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

    def on_validation_epoch_start(self) -> None:
        self.val_passes.append([])

    def validation_step(self, batch, batch_idx):
        self.val_passes[-1].append(batch["sample_id"].tolist())

    def on_fit_end(self) -> None:
        torch.save({"train": self.train_ids, "val": self.val_passes}, f"{self.out}.rank{self.global_rank}.pt")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(out: Path, spec: str, max_steps: int, *, devices: int = 1, ckpt_path=None, callbacks=(), dm_kw=None, **kw):
    """One ``trainer.fit``; returns (trainer, data module, per-rank records)."""
    dm = StatefulsetDataModule(spec, **{"micro_batch_size": B, "num_workers": 1, **(dm_kw or {})})
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp_fork" if devices > 1 else "auto",
        max_steps=max_steps,
        limit_val_batches=VAL_BATCHES,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        default_root_dir=str(out.parent),
        **kw,
    )
    trainer.fit(Recorder(str(out)), datamodule=dm, ckpt_path=ckpt_path)
    records = [torch.load(f"{out}.rank{r}.pt") for r in range(devices)]
    return trainer, dm, records


def layout(steps: range, rank: int = 0, world: int = 1, batch: int = B) -> list[list[int]]:
    return [[(t * world + rank) * batch + j for j in range(batch)] for t in steps]


def check_validation(passes, rank: int = 0, world: int = 1, allow_none: bool = False) -> None:
    """Every validation pass (sanity check included) is the same first batches of the split."""
    assert passes or allow_none, "no validation ran"
    for seen in passes:
        assert seen == layout(range(len(seen)), rank, world)
        assert len(seen) in (VAL_BATCHES, 1, 2)  # the sanity check runs num_sanity_val_steps batches


# --- single process ---------------------------------------------------------------------------------


def test_modelcheckpoint_resume_continues_exactly(tmp_path, spec):
    """Gradient accumulation 2, 3 steps per epoch; resume at mid-epoch and at an epoch end, other worker counts."""
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    common = {"accumulate_grad_batches": 2, "limit_train_batches": 6, "val_check_interval": 4}
    dm_kw = {"global_batch_size": 2 * B}
    _, dm, [full] = fit(tmp_path / "full", spec, 7, callbacks=[ckpt], dm_kw=dm_kw, **common)
    assert full["train"] == layout(range(14))  # 7 steps x 2 micro-batches, the contract's layout
    check_validation(full["val"])
    assert dm.consumed_samples == dm.train_loader.consumed_samples == 7 * 2 * B

    for step, workers in ((2, 0), (4, 2), (6, 1)):  # mid epoch 0, mid epoch 1, the end of epoch 1
        path = tmp_path / "ckpt" / f"epoch={(step - 1) // 3}-step={step}.ckpt"
        saved = torch.load(path, weights_only=False)
        entry = saved["StatefulsetDataModule"]
        assert entry["consumed_samples"] == step * 2 * B and entry["global_step"] == step
        assert [s["batches"] for s in entry["loader_states"]] == [2 * step]
        # Lightning's own loop keeps only the marker: it never restores the stream a second time.
        assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [TrainStageLoader._MARKER]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, dm2, [resumed] = fit(
                tmp_path / f"resumed{step}",
                spec,
                7,
                ckpt_path=str(path),
                dm_kw={**dm_kw, "num_workers": workers},
                **common,
            )
        assert not [w for w in caught if "not resumable" in str(w.message)]
        assert resumed["train"] == full["train"][2 * step :], step
        check_validation(resumed["val"], allow_none=step == 6)  # 1 step left: no validation due
        assert dm2.consumed_samples == dm2.train_loader.consumed_samples == 7 * 2 * B


def test_save_checkpoint_after_fit_and_resume_with_another_micro_batch_size(tmp_path, spec):
    """``trainer.save_checkpoint`` after ``fit``; the resumed run may use micro-batches of 2 x B (elastic)."""
    _, _, [full] = fit(tmp_path / "full", spec, 10, val_check_interval=3, limit_train_batches=5)
    assert full["train"] == layout(range(10))
    trainer, _, [first] = fit(tmp_path / "first", spec, 4, val_check_interval=3, limit_train_batches=5)
    trainer.save_checkpoint(str(tmp_path / "c.ckpt"))
    _, _, [same] = fit(
        tmp_path / "same", spec, 10, ckpt_path=str(tmp_path / "c.ckpt"), val_check_interval=3, limit_train_batches=5
    )
    assert first["train"] + same["train"] == full["train"]
    for record in (full, first, same):
        check_validation(record["val"])
    # 2 x B per micro-batch from step 4: the same samples in the same order, two old batches per new one.
    _, _, [wide] = fit(tmp_path / "wide", spec, 7, ckpt_path=str(tmp_path / "c.ckpt"), dm_kw={"micro_batch_size": 8})
    assert wide["train"] == [a + b for a, b in zip(full["train"][4::2], full["train"][5::2], strict=True)]


def test_second_fit_on_the_same_trainer_continues(tmp_path, spec):
    """Teardown stops the workers (no 5 s join per loader in the garbage collector) and keeps the position."""
    dm = StatefulsetDataModule(spec, micro_batch_size=B, num_workers=1)
    model = Recorder(str(tmp_path / "twice"))
    kw = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_checkpointing": False}
    trainer = L.Trainer(max_steps=3, val_check_interval=2, limit_val_batches=VAL_BATCHES, **kw)
    trainer.fit(model, datamodule=dm)
    trainer.fit_loop.epoch_loop.max_steps = 7
    trainer.fit(model, datamodule=dm)
    assert model.train_ids == layout(range(7))
    check_validation(model.val_passes)


# --- two DDP ranks ----------------------------------------------------------------------------------


def test_ddp_two_ranks_resume_and_resume_on_one(tmp_path, spec):
    """2 DDP ranks (forked, gloo): resume on 2 ranks exactly, and on 1 rank with micro-batches of 2 x B."""
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1)
    _, _, full = fit(tmp_path / "full", spec, 6, devices=2, callbacks=[ckpt], val_check_interval=4)
    for r in range(2):
        assert full[r]["train"] == layout(range(6), r, 2)
        check_validation(full[r]["val"], r, 2)
    path = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    states = torch.load(path, weights_only=False)["StatefulsetDataModule"]["loader_states"]
    assert [(s["dp_rank"], s["batches"]) for s in states] == [(0, 3), (1, 3)]  # both ranks' states, gathered

    _, _, resumed = fit(tmp_path / "resumed", spec, 6, devices=2, ckpt_path=str(path), val_check_interval=4)
    for r in range(2):
        assert resumed[r]["train"] == full[r]["train"][3:]
        check_validation(resumed[r]["val"], r, 2)
    _, _, [one] = fit(tmp_path / "one", spec, 6, ckpt_path=str(path), dm_kw={"micro_batch_size": 2 * B})
    assert one["train"] == [a + b for a, b in zip(full[0]["train"][3:], full[1]["train"][3:], strict=True)]


# --- the data module without a trainer --------------------------------------------------------------


def ids(loader, n: int) -> list[list[int]]:
    return [b["sample_id"].tolist() for _, b in zip(range(n), loader, strict=False)]


def test_modes_lengths_and_eval_loaders_restart(spec):
    dm = StatefulsetDataModule(spec, micro_batch_size=B, num_workers=0, limit_val_batches=3)
    train, val, test = dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader()
    assert (train.mode, val.mode, test.mode) == ("train", "validation", "test")
    assert len(train) == len(dm.train_loader) > 0 and len(val) == 3
    assert ids(val, 5) == ids(val, 5) == layout(range(3))  # every pass from the start, never resumed
    assert ids(test, 2) == layout(range(2))
    assert ids(train, 2) == layout(range(2)) and ids(train, 2) == layout(range(2, 4))  # one endless stream
    # A restore never touches evaluation loaders.
    dm2 = StatefulsetDataModule(spec, micro_batch_size=B, num_workers=0, limit_val_batches=3)
    dm2.load_state_dict(dm.state_dict())
    assert ids(dm2.train_dataloader(), 1) == layout(range(4, 5))
    assert ids(dm2.val_dataloader(), 5) == layout(range(3))


def test_reload_continues_and_bionemo_arithmetic(spec):
    """Loaders made again (reload_dataloaders_every_n_epochs, a second fit) continue; consumed_samples folds steps."""
    dm = StatefulsetDataModule(spec, micro_batch_size=B, global_batch_size=2 * B, num_workers=0)
    dm.trainer = SimpleNamespace(global_step=0, accumulate_grad_batches=2, strategy=SimpleNamespace())
    assert dm.num_micro_batches == 2
    first = dm.train_dataloader()
    assert len(first) % 2 == 0  # whole optimizer steps per Lightning epoch
    assert ids(first, 6) == layout(range(6))
    dm.trainer.global_step = 3
    assert dm.consumed_samples == 3 * 2 * B == dm.train_loader.consumed_samples
    again = dm.train_dataloader()  # update_init_global_step folds the 3 steps in
    assert (dm.init_global_step, dm.init_consumed_samples) == (3, 24)
    assert ids(again, 2) == layout(range(6, 8))
    dm.trainer.global_step = 4
    assert dm.state_dict()["consumed_samples"] == 32


def test_nemo_consumed_samples_state_resumes_megatron_style(spec):
    """A NeMo / BioNeMo data module's state is ``{"consumed_samples": n}``: resume at global position n."""
    for rank in range(2):
        dm = StatefulsetDataModule(spec, micro_batch_size=B, num_workers=0, dp_rank=rank, dp_size=2)
        dm.load_state_dict({"consumed_samples": 40})
        assert dm.consumed_samples == 40
        assert ids(dm.train_dataloader(), 2) == [[40 + (t * 2 + rank) * B + j for j in range(B)] for t in range(2)]


def test_pickles_with_its_position(spec):
    """``ddp_spawn`` pickles the data module: a copy continues the training stream where the original is."""
    import pickle

    dm = StatefulsetDataModule(spec, micro_batch_size=B, num_workers=1, limit_val_batches=1)
    assert ids(dm.train_dataloader(), 3) == layout(range(3))
    ids(dm.val_dataloader(), 1)
    copy = pickle.loads(pickle.dumps(dm))
    assert ids(copy.train_dataloader(), 2) == layout(range(3, 5))
    assert ids(copy.val_dataloader(), 1) == layout(range(1))


def test_state_dict_is_plain_data(spec, tmp_path):
    dm = StatefulsetDataModule(spec, micro_batch_size=B, num_workers=0)
    ids(dm.train_dataloader(), 3)
    torch.save(dm.state_dict(), tmp_path / "dm.pt")
    state = torch.load(tmp_path / "dm.pt")  # weights_only=True
    assert state["consumed_samples"] == 0  # no trainer: no optimizer step was taken
    assert state["loader_states"][0]["batches"] == 3


def test_errors_name_what_is_wrong(spec, tmp_path):
    def dm(**kw):
        return StatefulsetDataModule(spec, **{"micro_batch_size": B, "num_workers": 0, **kw})

    for kw, words in (
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"dp_rank": 1}, "dp_rank and dp_size"),
        ({"dp_rank": 2, "dp_size": 2}, "outside dp_size"),
        ({"shuffle": True}, "shuffle"),
        ({"limit_val_batches": 1.5}, "limit_val_batches"),
    ):
        with pytest.raises(StatefulsetError, match=words):
            dm(**kw)
    with pytest.raises(StatefulsetError):
        StatefulsetDataModule(str(tmp_path / "missing.yaml"), micro_batch_size=B)
    with pytest.raises(StatefulsetError, match="not a multiple"):
        _ = dm(global_batch_size=6).global_batch_size
    good = dm()
    ids(good.train_dataloader(), 2)
    state = good.state_dict()
    for bad, words in (
        ([], "expected a dict"),
        ({**state, "format": "other"}, "not a statefulset.datamodule"),
        ({**state, "consumed_samples": -1}, "consumed_samples"),
        ({**state, "loader_states": []}, "loader_states"),
        ({**state, "loader_states": [{"format": "x"}]}, r"loader_states\[0\]"),
    ):
        with pytest.raises(StatefulsetError, match=words):
            dm().load_state_dict(bad)
    with pytest.raises(StatefulsetError, match="already handed out"):
        good.load_state_dict(state)
    reseeded = demo_spec(str(Path(spec).parent), documents=600, seq_length=32, split="90,5,5", seed=99)
    other = StatefulsetDataModule(reseeded, micro_batch_size=B, num_workers=0)
    other.load_state_dict(state)
    with pytest.raises(StatefulsetError, match="seed"):
        other.train_dataloader()
    two = dm(dp_rank=0, dp_size=2)
    ids(two.train_dataloader(), 1)
    with pytest.raises(StatefulsetError, match=r"torch\.distributed is not initialised"):
        two.state_dict()


def test_without_lightning_the_import_says_what_to_install():
    code = (
        "import sys\n"
        "for name in ('lightning', 'lightning.pytorch', 'pytorch_lightning'):\n"
        "    sys.modules[name] = None\n"
        "from statefulset import StatefulsetError\n"
        "try:\n"
        "    import statefulset.integrations.lightning.datamodule\n"
        "except StatefulsetError as exc:\n"
        "    print(exc)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install statefulset[lightning]" in run.stdout, run.stdout + run.stderr


def test_the_datamodule_logs_the_loader_metrics_to_the_trainer_loggers(tmp_path, spec):
    from lightning.pytorch.loggers import Logger

    class Kept(Logger):
        def __init__(self):
            super().__init__()
            self.logged: list[tuple[int, dict]] = []

        name, version = "kept", 0

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            if any(k.startswith("data/") for k in metrics):
                self.logged.append((step, dict(metrics)))

    kept = Kept()
    dm = StatefulsetDataModule(spec, micro_batch_size=B, num_workers=1, log_metrics_every_n_steps=2)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=5, limit_val_batches=0, logger=kept, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(Recorder(str(tmp_path / "r")), datamodule=dm)
    assert [step for step, _ in kept.logged] == [0, 2, 4]
    last = kept.logged[-1][1]
    assert last["data/batches"] == 5 and last["data/position"] == 5 * B  # the batches of steps 0..4 were taken
    assert last["data/data_wait_seconds"] > 0
    assert any(k.startswith("data/source/") and k.endswith("/weight") for k in last)


def test_a_masked_source_gives_lightning_batches_its_loss_mask(tmp_path):
    """Issue 28: a source with a mask shard (CONTRACT §16) gives the datamodule's training batches
    ``loss_mask``, each row the dataset's own for that sample id, with workers too."""
    import numpy

    from statefulset import IndexedDatasetWriter, get_train_dataset

    prefix = str(tmp_path / "sft")
    rng = numpy.random.default_rng(4)
    with IndexedDatasetWriter(prefix, numpy.int32) as w, IndexedDatasetWriter(prefix + "_loss_mask", numpy.uint8) as m:
        for d in range(300):
            n = int(rng.integers(3, 40))
            w.add_document(numpy.arange(n, dtype=numpy.int32) + d)
            m.add_document((rng.random(n) < 0.5).astype(numpy.uint8))
    spec = {"data_path": prefix, "seq_length": 32, "split": "100,0,0", "seed": 2, "path_to_cache": str(tmp_path / "c")}
    dataset = get_train_dataset(spec, batch_size=B)
    dm = StatefulsetDataModule(spec, micro_batch_size=B, num_workers=1)
    train = iter(dm.train_dataloader())
    for _ in range(5):
        batch = next(train)
        assert batch["loss_mask"].dtype == torch.float32 and batch["loss_mask"].shape == (B, 32)
        for row, p in zip(batch["loss_mask"], batch["sample_id"].tolist(), strict=True):
            assert row.tolist() == torch.as_tensor(dataset[p]["loss_mask"]).tolist()
        assert 0 < float(batch["loss_mask"].mean()) < 1
