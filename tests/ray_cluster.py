"""A real two-node Ray cluster on this machine, for tests: ``python tests/ray_cluster.py``.

Ray's own ``ray.cluster_utils.Cluster`` starts a head node and a second node (its own raylet,
object store and workers) on loopback. The process prints the cluster's address, then obeys lines
on stdin: ``remove`` kills the second node at once (a lost machine), anything else (or EOF) shuts
the cluster down. :func:`two_nodes` drives it with a bounded wait for every answer.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))


class ClusterProcess:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.address = self._answer("the cluster's address", 180)

    def _answer(self, what: str, seconds: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], seconds)
        line = self.proc.stdout.readline().strip() if ready else ""
        if not line:
            self.proc.kill()
            raise RuntimeError(f"tests/ray_cluster.py gave no {what} within {seconds:g} s")
        return line

    def remove_second_node(self) -> None:
        self.proc.stdin.write("remove\n")
        self.proc.stdin.flush()
        self._answer("word that the node was removed", 60)


@contextlib.contextmanager
def two_nodes() -> Iterator[ClusterProcess]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "ray_cluster.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        yield ClusterProcess(proc)
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.write("stop\n")
            proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def main() -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    print(cluster.address, flush=True)
    try:
        for line in sys.stdin:
            if line.strip() != "remove":
                break
            cluster.remove_node(second, allow_graceful=False)
            print("removed", flush=True)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
