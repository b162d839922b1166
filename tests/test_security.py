"""The embedded cluster is reachable from this host only.

While a run trains, its rank-0 worker's torch.distributed store (torch's TCPStore, which Ray Train's
env:// rendezvous starts) listens on every interface: torch offers that rendezvous no address to bind,
and on a cluster of several nodes the other nodes' workers join through it. The cluster is shared by
the session's tests, so the check waits for an earlier test's Ray Train workers to exit first."""

import os
import re
import subprocess
import time

import psutil
import pytest

pytestmark = pytest.mark.ray

LOOPBACK = re.compile(r"^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):\d+$")


def _command(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline()).strip()[:200]
    except psutil.Error:
        return f"pid {pid}, gone"


def _ours() -> set[int]:
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


def _train_workers(pids) -> list[str]:
    return [c for c in map(_command, pids) if "RayTrainWorker" in c]


def test_embedded_cluster_listens_on_loopback_only(ray_cluster):
    deadline = time.monotonic() + 120
    while (left := _train_workers(_ours())) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"an earlier run's Ray Train workers did not exit in 120 s: {left}"
    ours = _ours()
    listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    addresses = [(line.split()[3], int(m.group(1))) for line in listening
                 if (m := re.search(r"pid=(\d+)", line)) and int(m.group(1)) in ours]
    assert addresses, "found no listening socket of the cluster's processes"
    exposed = [(a, _command(pid)) for a, pid in addresses if not LOOPBACK.match(a)]
    assert exposed == []
    assert ray_cluster.get_runtime_context().gcs_address.startswith("127.0.0.1:")
