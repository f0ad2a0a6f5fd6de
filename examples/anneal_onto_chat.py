"""Annealing onto chat data: web text, then a stage that adds a chat source whose loss counts on answers only.

Runs with no arguments on CPU in a temporary folder: writes conversations as JSON lines, renders
them with a ChatML template into segments (``statefulset preprocess --chat-template``: a token
shard and its loss-mask shard), reads 20 steps of a one-stage web schedule, saves, appends an
annealing stage that mixes the chat source in at position 100, resumes with another worker
count, and checks that the run continues exactly like the new schedule read from the start,
``loss_mask`` included (1 on web labels, 0 on prompts and assistant headers, 1 on answers).
See docs/instruction-data.md.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy
import yaml

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.tools import chat
from statefulset.tools.demo import demo_spec
from statefulset.tools.preprocess import preprocess

BATCH = 4
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_chats(folder: str) -> str:
    """Conversations as JSON lines, preprocessed into ``chat_messages_document`` (+ its loss mask)."""
    rng = numpy.random.default_rng(0)
    with open(os.path.join(folder, "chats.jsonl"), "w") as f:
        for i in range(300):
            a, b = (int(x) for x in rng.integers(0, 100, 2))
            messages = [
                {"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
            ]
            f.write(json.dumps({"id": i, "messages": messages}) + "\n")
    with open(os.path.join(folder, "chatml.jinja"), "w") as f:
        f.write(CHATML)
    template = chat.load(os.path.join(folder, "chatml.jinja"), ("assistant",))
    prefix = os.path.join(folder, "chat")
    result = preprocess([os.path.join(folder, "chats.jsonl")], prefix, json_keys=("messages",), chat=template,
                        append_eod=True, show_progress=False)  # fmt: skip
    print(result.summary().replace(folder, "<tmp>"))
    return result.outputs["messages"]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="statefulset-chat-") as folder:
        path = demo_spec(folder, seq_length=64)  # two byte-tokenised web shards beside their spec
        with open(path) as f:
            web = os.path.join(folder, next(iter(yaml.safe_load(f)["data_path"])))
        chats = write_chats(folder)
        base = {"seq_length": 64, "split": "1", "packing": "bestfit", "path_to_cache": os.path.join(folder, "cache")}
        first = {**base, "stages": [{"start": 0, "data_path": {web: 1.0}}]}
        annealed = {**first, "stages": [*first["stages"], {"start": 100, "data_path": {web: 0.5, chats: 0.5}}]}

        def loader(spec: dict, workers: int):
            wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
            return get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))

        run = loader(first, workers=2)
        for _, _batch in zip(range(20), run, strict=False):
            pass
        state = run.save_state_rank()  # position 80: the chat stage has not begun

        resumed = loader(annealed, workers=1)
        resumed.restore_state_rank(state)
        got = [b for _, b in zip(range(20), resumed, strict=False)]
        reference = get_train_dataset(annealed, batch_size=BATCH)
        for batch in got:
            for row, position in enumerate(batch["sample_id"].tolist()):
                sample = reference[position]
                assert (batch["text"][row].numpy() == sample["text"]).all()
                assert (batch["loss_mask"][row].numpy() == sample["loss_mask"]).all()
        chat_rows = [
            reference[p] for p in range(100, 160) if reference.explain(p).source == chats
        ]  # the annealing stage's chat samples
        learnt = sum(float(s["loss_mask"].sum()) for s in chat_rows)
        labels = sum(int((s["text"][1:] >= 0).sum()) for s in chat_rows)
        assert chat_rows and 0 < learnt < labels  # answers learnt, prompts and headers not
        print(f"{len(chat_rows)} chat samples in positions [100, 160): loss on {learnt / labels:.0%} of their labels")
        print("anneal_onto_chat: resumed into the chat stage on exactly the next samples, masks included")


if __name__ == "__main__":
    main()
