"""The embedded cluster is reachable from this host only."""

import os
import re
import subprocess

import psutil
import pytest

pytestmark = pytest.mark.ray


def test_embedded_cluster_listens_on_loopback_only(ray_cluster):
    ours = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    addresses = [line.split()[3] for line in listening
                 if (m := re.search(r"pid=(\d+)", line)) and int(m.group(1)) in ours]
    assert addresses, "found no listening socket of the cluster's processes"
    exposed = [a for a in addresses if not re.match(r"^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):\d+$", a)]
    assert exposed == []
    assert ray_cluster.get_runtime_context().gcs_address.startswith("127.0.0.1:")
