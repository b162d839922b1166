import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def info(tmp_path_factory):
    """info(name) -> the prepared data set's DatasetInfo as a dict (prepared once per session)."""
    from raytrain_par import config, data

    cache: dict[str, dict] = {}

    def get(name, **data_keys):
        key = (name, tuple(sorted(data_keys.items())))
        if key not in cache:
            spec = config.DataSpec(name=name, **{"vocab_size": config.DEFAULT_VOCAB_SIZE, **data_keys})
            cache[key] = data.prepare(spec, log=lambda *_: None).to_json()
        return cache[key]

    return get


@pytest.fixture(scope="session")
def ray_cluster():
    """One embedded Ray cluster for every end-to-end test of the session (starting one costs ~10 s)."""
    import ray

    from raytrain_par.driver import start_local_cluster, worker_env

    start_local_cluster(num_cpus=4, env=worker_env())
    yield ray
    ray.shutdown()


REPO = Path(__file__).resolve().parent.parent


def experiment_file(name: str) -> Path:
    return REPO / "experiments" / name
