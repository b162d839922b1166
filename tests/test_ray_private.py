"""Ray's private modules are imported in raytrain_par/ray_private.py only, and every private name it
uses still exists in the installed Ray: a Ray upgrade that moves one fails here, by name, rather
than in the middle of a run."""

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO

PRIVATE_MODULE = REPO / "raytrain_par" / "ray_private.py"
SOURCES = sorted([*(REPO / "raytrain_par").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")])


def _private(dotted: str) -> bool:
    """A module path inside Ray that Ray marks private: a part after `ray` that starts with `_`
    (ray._private, ray._common, ray._raylet, ray.data._internal, ray.autoscaler._private, ...)."""
    parts = dotted.split(".")
    return parts[0] == "ray" and any(p.startswith("_") and not p.endswith("__") for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def private_ray_uses(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, module) for each import of a private Ray module, and each attribute path that steps
    into one from `ray` (ray._private.worker.global_worker)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            found += [(node.lineno, m) for m in modules if _private(m)][:1]
        elif isinstance(node, ast.Attribute):
            base = _dotted(node.value)
            # the first private step only, not every longer path through it
            if base and base.split(".")[0] == "ray" and not _private(base) and _private(f"{base}.{node.attr}"):
                found.append((node.lineno, f"{base}.{node.attr}"))
    return sorted(found)


def test_only_ray_private_uses_private_ray_modules():
    offenders = {str(p.relative_to(REPO)): uses for p in SOURCES if p != PRIVATE_MODULE
                 for uses in [private_ray_uses(p.read_text(), str(p))] if uses}
    assert not offenders, ("private Ray modules used outside raytrain_par/ray_private.py (move the use "
                           f"there, saying why no public API serves): {offenders}")


def test_the_scan_finds_private_uses():
    """The scan sees every kind of use, and passes public ones; ray_private.py has some to find."""
    source = textwrap.dedent("""\
        import ray._private.services
        from ray._private import ray_constants
        from ray.data._internal.stats import get_or_create_stats_actor
        from ray import _raylet
        x = ray._private.worker.global_worker
        import ray
        from ray.train import Checkpoint
        from . import ray_private
        y = ray.util.get_node_ip_address(), ray.__version__, handle.__ray_ready__
        """)
    assert [line for line, _ in private_ray_uses(source)] == [1, 2, 3, 4, 5]
    assert private_ray_uses(PRIVATE_MODULE.read_text())


def _private_names() -> list[tuple[str, str]]:
    """(module, name) for every `from ray... import name` in ray_private.py."""
    tree = ast.parse(PRIVATE_MODULE.read_text())
    return sorted({(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0
                   and n.module.startswith("ray") for a in n.names})


@pytest.mark.parametrize("module,name", _private_names(), ids=lambda v: v)
def test_each_private_name_still_exists(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone from Ray"


def test_the_cheap_helpers_answer():
    """Those that need no cluster. prepare_config, validate_config and kuberay_autoscaling_config run
    on every file in clusters/ in test_clusters.py; the stats actor and autoscaling coordinator are
    created by every Ray run."""
    import ipaddress

    from ray._private import ray_constants

    from raytrain_par import ray_private

    assert ray_private.gcs_port_env_var().startswith("RAY_")
    flag, name = ray_constants.ENABLE_RAY_CLUSTER, ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    before = os.environ.get(name)
    with ray_private.single_machine_mode():
        assert ray_constants.ENABLE_RAY_CLUSTER is False and os.environ[name] == "0"
    assert ray_constants.ENABLE_RAY_CLUSTER == flag and os.environ.get(name) == before
    ipaddress.ip_address(ray_private.node_ip_address_from_perspective())
    assert ray_private.fake_multinode_head_type()
    assert Path(ray_private.train_context_logger_name()).is_file()
    assert Path(ray_private.ray_address_file()).is_absolute()
    assert importlib.util.find_spec(ray_private.DATA_PROGRESS_LOGGER) is not None
    # storage_context() needs a Ray Train worker (async checkpoints run it in every Ray run); what it
    # returns must still copy a checkpoint as Ray Train's own upload does
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2.api.context import TrainContext

    assert hasattr(TrainContext, "get_storage") and hasattr(StorageContext, "persist_current_checkpoint")


def test_importing_ray_private_imports_no_ray():
    code = "import sys, raytrain_par.ray_private; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
