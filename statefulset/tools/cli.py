"""The ``statefulset`` command: preprocess, merge, inspect, explain, prepare, demo."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence

from statefulset.errors import StatefulsetError


def _preprocess(args: argparse.Namespace) -> int:
    from statefulset.shards.tokenizers import BYTES, TokenizerSpec
    from statefulset.tools import chat
    from statefulset.tools.preprocess import preprocess

    spec = TokenizerSpec(args.tokenizer or BYTES, args.eod_token, not args.no_special_tokens)
    common = {
        "json_keys": args.json_keys,
        "tokenizer": spec,
        "append_eod": args.append_eod,
        "skip_bad_lines": args.skip_bad_lines,
        "dtype": args.dtype,
        "chunk_bytes": args.chunk_bytes,
        "show_progress": not args.quiet,
        "chat": None if args.chat_template is None else chat.load(args.chat_template, tuple(args.loss_roles)),
    }
    if args.executor == "ray" and args.workers is not None:
        raise StatefulsetError("--workers applies to --executor local (with --executor ray, every CPU of Ray works)")
    if args.executor == "local" and (args.task_bytes is not None or args.ray_address is not None):
        raise StatefulsetError("--task-bytes and --ray-address apply to --executor ray")
    if args.executor == "ray":
        from statefulset.tools.part_tasks import preprocess_ray

        result = preprocess_ray(
            args.input, args.output_prefix, task_bytes=args.task_bytes, ray_address=args.ray_address, **common
        )
    else:
        result = preprocess(args.input, args.output_prefix, workers=args.workers or 1, **common)
    print(result.summary())
    return 0


def _merge(args: argparse.Namespace) -> int:
    from statefulset.shards.merge import merge_datasets
    from statefulset.shards.names import find_prefixes, refuse_mixed_keys
    from statefulset.shards.reader import IndexedDataset

    prefixes: list[str] = []
    for item in args.input:
        if os.path.isdir(item) or any(c in item for c in "*?["):
            found = find_prefixes(item)
            if not found:
                raise StatefulsetError(f"{item}: no .bin/.idx pairs found")
            prefixes += found
        elif IndexedDataset.exists(item):
            prefixes.append(item)
        else:
            raise StatefulsetError(f"{item}: neither a folder of shards nor a prefix with .bin and .idx")
    if not args.allow_mixed_keys:
        refuse_mixed_keys(prefixes, " ".join(args.input), "--allow-mixed-keys")
    output = os.path.abspath(args.output_prefix)
    if any(os.path.abspath(p) == output for p in prefixes):  # a rerun into the same folder
        raise StatefulsetError(
            f"{args.output_prefix}: the output is also one of the inputs (an earlier merge?); "
            "merging it again would repeat its data: write elsewhere, or remove it first"
        )
    merged = merge_datasets(prefixes, args.output_prefix, multimodal=args.multimodal)
    print(f"merged {len(prefixes)} shards into {merged.path_prefix}: {merged!r}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from statefulset.tools.inspection import inspect_shard
    from statefulset.tools.preview import is_spec_path, preview_spec

    status = 0
    for prefix in args.prefix:
        if is_spec_path(prefix) and args.at is not None:
            from statefulset.tools.schedule_report import schedule_report

            report = schedule_report(prefix, args.at)
        elif is_spec_path(prefix):
            report = preview_spec(prefix)
        else:
            report = inspect_shard(prefix, multimodal=args.multimodal, vocab_size=args.vocab_size)
        print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
        status = status or (0 if report.valid else 1)
    return status


def _report(args: argparse.Namespace) -> int:
    from statefulset.tools.metrics_report import report

    for path in report(args.source, args.spec, args.out):
        print(path)
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from statefulset.tools.prepare import prepare

    print(prepare(args.spec, args.splits, jobs=args.jobs, show_progress=not args.quiet).text())
    return 0


def _explain(args: argparse.Namespace) -> int:
    from statefulset.loading.datasets import get_train_dataset, get_val_dataset
    from statefulset.loading.worker_config import WorkerConfig
    from statefulset.streams.provenance import StepLayout, decoder_for

    if args.step is None:
        if any(
            v is not None for v in (args.global_batch_size, args.dp_size, args.micro_batch_size, args.rank, args.row)
        ):
            raise StatefulsetError(
                "--global-batch-size, --dp-size, --micro-batch-size, --rank and --row go with --step"
            )
        layout, positions = None, args.position
    else:
        layout = StepLayout.of(args.global_batch_size, args.dp_size, args.micro_batch_size)
        positions = layout.positions(args.step, args.rank, args.row)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    if args.split == "train":
        ds = get_train_dataset(args.spec, batch_size=1, worker_config=wc)
    else:
        ds = get_val_dataset(args.spec, split_part=args.split, batch_size=1, worker_config=wc)
    decoder = decoder_for(args.tokenizer)
    found = [ds.explain(p, tokenizer=decoder) for p in positions]
    if args.json:
        rows = [{**f.as_dict(), **(layout.locate(f.position) if layout else {})} for f in found]
        print(json.dumps(rows, indent=2))
        return 0
    blocks = []
    for f in found:
        where = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in layout.locate(f.position).items()) if layout else ""
        blocks.append((f"{where}:\n" if where else "") + f.text())
    print("\n\n".join(blocks))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from statefulset.tools.demo import run_demo

    return 0 if run_demo(args.dir, args.documents) else 1


def _version() -> str:
    from statefulset import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="statefulset", description="Deterministic, savable data loading on Megatron bin/idx shards."
    )
    parser.add_argument("--version", action="version", version=f"statefulset {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    # Each command: its name, its line in --help, and what adds its arguments (and the function it runs).
    commands = (
        ("preprocess", "tokenise JSON lines into <prefix>_<key>_document.{bin,idx}", _preprocess_arguments),
        ("merge", "concatenate shards (folders in natural order: part_2 before part_10)", _merge_arguments),
        (
            "inspect",
            "statistics and a full validity check of shards; or a spec's splits, sources and samples",
            _inspect_arguments,
        ),
        (
            "explain",
            "where samples came from: source shard, sequences, documents, token offsets, epoch (docs/provenance.md)",
            _explain_arguments,
        ),
        (
            "prepare",
            "check and hash every shard and build the indices of a spec once, into its path_to_cache (docs/scale.md)",
            _prepare_arguments,
        ),
        (
            "report",
            "PNG plots: achieved vs target share per source, data wait per step by rank (docs/observability.md)",
            _report_arguments,
        ),
        ("demo", "run the main job on a built-in corpus (no downloads)", _demo_arguments),
    )
    for name, summary, add_arguments in commands:
        add_arguments(sub.add_parser(name, help=summary))
    return parser


def _preprocess_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``statefulset preprocess``."""
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="JSON-lines files (plain or .gz), Parquet files (pyarrow), or glob patterns",
    )
    p.add_argument("--output-prefix", required=True)
    p.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys (Parquet: columns) to tokenise, one shard each"
    )
    p.add_argument(
        "--tokenizer",
        "--tokenizer-model",
        default=None,
        help="'bytes' (built in, default) or a local tokenizer.json / tokenizer folder",
    )
    p.add_argument("--eod-token", default=None, help="end-of-document token of a Hugging Face tokenizer")
    p.add_argument("--no-special-tokens", action="store_true", help="do not add the tokenizer's BOS/EOS etc.")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default 1); output is in input order")
    p.add_argument("--dtype", default=None, help="token dtype (default: uint16 if the vocabulary fits, else int32)")
    p.add_argument("--skip-bad-lines", action="store_true", help="count and report malformed lines, go on")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="input bytes per unit of work")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (Hugging Face format): a key holding [{role, content}, ...] becomes segments",
    )
    p.add_argument(
        "--loss-roles", nargs="+", default=["assistant"], help="with --chat-template: the roles whose turns have loss"
    )
    p.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="local: --workers processes here; ray: Ray tasks that commit parts, merged in order, resumable",
    )
    p.add_argument("--ray-address", default=None, help="a Ray cluster to run on (default: start a local one)")
    p.add_argument(
        "--task-bytes",
        type=int,
        default=None,
        help="input bytes per Ray task (default 64 MiB, less on a small input: about 8 tasks per CPU)",
    )
    p.set_defaults(run=_preprocess)


def _merge_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``statefulset merge``."""
    p.add_argument("--input", nargs="+", required=True, help="folders, glob patterns or prefixes")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--multimodal", action="store_true")
    p.add_argument(
        "--allow-mixed-keys",
        action="store_true",
        help="merge shards of different JSON keys (x_text_document with x_title_document) into one",
    )
    p.set_defaults(run=_merge)


def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``statefulset inspect``."""
    p.add_argument("prefix", nargs="+", help="shard prefix (path without .bin/.idx), or a dataset spec .yaml/.yml")
    p.add_argument("--multimodal", action="store_true")
    p.add_argument("--vocab-size", type=int, default=None, help="also check every token id is below this")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--at",
        type=int,
        default=None,
        metavar="POSITION",
        help="for a spec: the train stream at this global sample position (step x global batch): its stage, each "
        "source's samples, share so far and epochs (docs/schedules.md)",
    )
    p.set_defaults(run=_inspect)


def _explain_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``statefulset explain``."""
    p.add_argument("spec", help="the dataset spec (.yaml)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--position", type=int, nargs="+", metavar="P", help="global position(s): batch['sample_id']")
    which.add_argument("--step", type=int, metavar="S", help="optimizer step S: the positions [S*G, (S+1)*G)")
    p.add_argument("--global-batch-size", type=int, metavar="G", help="samples per step (default W*B)")
    p.add_argument("--dp-size", type=int, metavar="W", help="data-parallel ranks")
    p.add_argument("--micro-batch-size", type=int, metavar="B", help="rows per micro-batch and rank")
    p.add_argument("--rank", type=int, metavar="R", help="only DP rank R's rows of the step (needs W and B)")
    p.add_argument("--row", type=int, metavar="J", help="only row J of the rank's micro-batches")
    p.add_argument("--split", default="train", choices=["train", "valid", "test"])
    p.add_argument("--tokenizer", metavar="PATH|bytes", help="add decoded text: 'bytes' or a tokenizer.json (folder)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_explain)


def _prepare_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``statefulset prepare``."""
    p.add_argument("spec", help="the dataset spec (.yaml)")
    p.add_argument(
        "--splits", nargs="+", choices=["train", "valid", "test"], help="default: every split the spec builds"
    )
    p.add_argument("--jobs", type=int, default=1, help="shards checked and hashed at once (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_prepare)


def _report_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``statefulset report``."""
    p.add_argument("source", help="metrics lines (.jsonl: step, rank and loader.metrics()) or a saved loader state")
    p.add_argument("--spec", required=True, help="the dataset spec (.yaml) the run trained on")
    p.add_argument("--out", default=".", help="folder for shares.png and data_wait.png (default: here)")
    p.set_defaults(run=_report)


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``statefulset demo``."""
    p.add_argument("--dir", default="statefulset-demo", help="where the demo writes its files")
    p.add_argument("--documents", type=int, default=6000)
    p.set_defaults(run=_demo)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: workers stopped, temporaries removed


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if in_main_thread else None
    try:
        return args.run(args)
    except StatefulsetError as exc:
        print(f"statefulset {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`statefulset explain ... | head`): not an error of ours. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a tool cut off by its reader
    finally:
        if in_main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
