"""What torchft's own ``DistributedSampler`` loses where ``FaultTolerantLoader`` loses nothing (issue 31).

``python benchmarks/bench_torchft_sampler.py [--quick]``: the scenario of examples/torchft_replicas.py
(torchft's lighthouse on loopback, 3 replica groups as gloo processes, random replicas SIGKILLed
mid-step and restarted, healing from their peers; one commit made to fail on every replica) with the
same seed for three loaders:

- ``statefulset``: ``FaultTolerantLoader`` (no loader state anywhere);
- ``sampler``: ``torchft.data.DistributedSampler`` (shard = replica id of 3) under a DataLoader; a
  restarted replica starts its shard again (no loader checkpoint);
- ``sampler-ckpt``: the same, with a per-replica loader checkpoint written after every step and
  read on restart (what torchtitan's fault-tolerant mode does).

From what each replica logged for its committed steps: samples trained, how many of them were
repeats, and holes (positions below the highest one trained that no committed step trained). Counts,
not timings: ``--seeds`` scenarios each. Results: ``benchmarks/results/bench_torchft_sampler.json``
(``--quick``: ``benchmarks/out/quick/``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

LOADERS = ("statefulset", "sampler", "sampler-ckpt")


def _example():
    spec = importlib.util.spec_from_file_location(
        "torchft_replicas", os.path.join(ROOT, "examples", "torchft_replicas.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="smoke run (60 steps, 1 kill, 1 seed)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.kills, args.seeds = 60, 1, [1]

    from benchenv import environment, git_state, load_average
    from provenance import version, write_results

    from statefulset.tools.demo import demo_spec

    example = _example()
    runs: dict[str, list[dict]] = {kind: [] for kind in LOADERS}
    with tempfile.TemporaryDirectory(prefix="bench-torchft-sampler-") as folder:
        spec = demo_spec(os.path.join(folder, "corpus"), documents=600)
        for seed in args.seeds:
            for kind in LOADERS:
                logs = os.path.join(folder, f"{kind}-{seed}")
                os.makedirs(logs)
                found = example.story(logs, spec, steps=args.steps, kills=args.kills, seed=seed, loader=kind)
                runs[kind].append({"seed": seed, **found})
    result = {
        "environment": {**environment(), "torchft": version("torchft") or "not installed"},
        "git": git_state(),
        "load": load_average(),
        "steps": args.steps,
        "kills": args.kills,
        "seeds": args.seeds,
        "runs": runs,
    }
    out = write_results("bench_torchft_sampler", result, path=args.out, quick=args.quick)
    print(f"{args.steps} steps, {args.kills} kills, seeds {args.seeds}; results {out}")
    print(f"  {'loader':<13} {'trained':>8} {'repeated':>9} {'holes':>6}")
    for kind, found in runs.items():
        for run in found:
            print(f"  {kind:<13} {run['trained']:>8} {run['duplicated']:>9} {run['holes']:>6}  (seed {run['seed']})")


if __name__ == "__main__":
    main()
