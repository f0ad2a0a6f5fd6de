"""An annealing schedule that resumes: a web/code mixture, then a high-quality stage appended mid-run.

Runs with no arguments on CPU in a temporary folder: trains (reads) 30 steps of a one-stage
schedule, saves, appends an annealing stage at position 200 (after the save), resumes with
another worker count, and checks that the run continues exactly like the new schedule read from
the start, that no source repeated a sample, and where each source stands (as ``statefulset
inspect SPEC --at P`` prints it).
"""

from __future__ import annotations

import os
import tempfile

import numpy
import yaml

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset, open_stream
from statefulset.tools.demo import demo_spec
from statefulset.tools.schedule_report import schedule_report

BATCH = 4


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="statefulset-anneal-") as folder:
        path = demo_spec(folder, seq_length=64)  # two byte-tokenised shards beside their spec
        with open(path) as f:
            web, code = (os.path.join(folder, prefix) for prefix in yaml.safe_load(f)["data_path"])
        base = {"seq_length": 64, "split": "1", "packing": "native", "path_to_cache": os.path.join(folder, "cache")}
        first = {**base, "stages": [{"start": 0, "data_path": {web: 0.8, code: 0.2}}]}
        # The annealing stage: only the second shard, from position 200 on.
        annealed = {**first, "stages": [*first["stages"], {"start": 200, "data_path": code}]}

        def loader(spec: dict, workers: int):
            wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
            return get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))

        run = loader(first, workers=2)
        for _, _batch in zip(range(30), run, strict=False):
            pass
        state = run.save_state_rank()  # position 120: the annealing stage has not begun

        resumed = loader(annealed, workers=1)
        resumed.restore_state_rank(state)
        got = numpy.concatenate([b["text"].numpy() for _, b in zip(range(40), resumed, strict=False)])
        stream = open_stream(annealed)
        assert (got == stream.gather(numpy.arange(120, 120 + 40 * BATCH))).all()

        which, local = stream.locate(numpy.arange(280))
        for s in range(len(stream.sources)):  # each source's samples 0, 1, 2, ...: none repeated, none skipped
            assert (numpy.sort(local[which == s]) == numpy.arange(int((which == s).sum()))).all()
        spec_path = os.path.join(folder, "annealed.yaml")
        with open(spec_path, "w") as f:
            yaml.safe_dump(annealed, f, sort_keys=False)
        print(schedule_report(spec_path, 280).text().replace(folder, "<tmp>"))
        print("annealing_resume: resumed into the appended stage on exactly the next samples")


if __name__ == "__main__":
    main()
