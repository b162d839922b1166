"""The parts of Ray's private modules this package relies on, where Ray 2.60 has no public API that
does the same. Every name here was checked against Ray 2.60.0; after a Ray upgrade,
tests/test_ray_private.py says which of them moved.

Ray is imported inside each function only: importing this module imports no Ray, and a name that
moved fails where it is used, naming the Ray module.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

# The logger of Ray Data's progress bars, which warns once per worker that the bars are off
# (DataContext.enable_progress_bars = False is what makes it warn, so only the logger's level
# silences it). Ray names it after its private module. Checked against Ray 2.60.0.
DATA_PROGRESS_LOGGER = "ray.data._internal.progress"


def gcs_port_env_var() -> str:
    """The environment variable a head started by ray.init reads its GCS port from.

    ray.init has no port argument (only `ray start --port` does); the head reads
    RAY_GCS_SERVER_PORT, which Ray does not document. Taken from Ray's constants rather than written
    out, so that a rename fails here instead of silently starting on a random port. Checked against
    Ray 2.60.0 (ray._private.node reads it for a head without a persisted port)."""
    from ray._private import ray_constants

    return ray_constants.GCS_PORT_ENVIRONMENT_VARIABLE


@contextmanager
def single_machine_mode():
    """Ray's single-machine mode (the macOS / Windows default) for the block: Ray binds its servers
    and resolves "localhost" to the loopback address, not the machine's network address.

    No public switch exists. Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER into
    ray_constants.ENABLE_RAY_CLUSTER once, at import, so the constant is set for this process and
    the variable for the processes it starts. Checked against Ray 2.60.0."""
    from ray._private import ray_constants

    name = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    saved_flag, saved_env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(name)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[name] = "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved_env


def node_ip_address_from_perspective() -> str:
    """This machine's network address as Ray finds it (the interface of the default route), which
    ray.init puts in place of 127.0.0.1 / localhost.

    The public ray.util.get_node_ip_address answers the connected node's address instead once this
    process is connected (127.0.0.1 for an embedded cluster), and the loopback address in
    single-machine mode. Checked against Ray 2.60.0 (ray._raylet, re-exported by
    ray._private.services)."""
    from ray._private.services import node_ip_address_from_perspective

    return node_ip_address_from_perspective()


def create_data_stats_actor() -> None:
    """Create Ray Data's per-cluster stats actor now, on this process's node (Ray Data creates it on
    the node of the first process that runs a dataset, and it never goes away).

    Ray Data has no public way to create or place it. Checked against Ray 2.60.0."""
    from ray.data._internal.stats import get_or_create_stats_actor

    get_or_create_stats_actor()


def autoscaling_coordinator():
    """Ray's autoscaling coordinator actor (one detached actor per cluster, which Ray Train's
    controller asks for workers), created on this process's node if it does not exist yet.

    Ray has no public handle to it. Checked against Ray 2.60.0."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator)

    return get_or_create_autoscaling_coordinator()


def storage_context():
    """The worker's Ray Train storage context, whose `persist_current_checkpoint` copies a checkpoint
    directory to the run's storage as Ray Train's own upload does. A checkpoint written by a
    `checkpoint_upload_fn` (worker.py: written in the background) then hands it over the same way.
    `TrainContext.get_storage` is a DeveloperAPI ("may change without notice between minor
    versions"). Checked against Ray 2.60.0."""
    import ray.train

    return ray.train.get_context().get_storage()


def train_context_logger_name() -> str:
    """The logger Ray Train's per-report INFO lines go to. Ray Train names it after its source file,
    outside the `ray.train` logger hierarchy that RunConfig's LoggingConfig filters, so the name can
    only be had from that (private) module. Checked against Ray 2.60.0."""
    from ray.train.v2._internal.execution import context

    return context.__file__


def prepare_config(config: dict) -> dict:
    """A cluster-launcher config with Ray's provider defaults filled in, as `ray up` prepares it.

    The public ray.autoscaler.sdk.fillout_defaults does only the first step of this (no setup-command
    merge, Docker check or per-node-type worker limits), and sdk.bootstrap_config calls the cloud.
    Checked against Ray 2.60.0."""
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(config)


def validate_config(config: dict) -> None:
    """Ray's check of a prepared cluster-launcher config: ray-schema.json plus the rules `ray up`
    applies beyond it (head node type, worker limits). Raises what Ray raises.

    No public API validates a config without launching it. Checked against Ray 2.60.0."""
    from ray.autoscaler._private.util import validate_config

    validate_config(config)


def fake_multinode_head_type() -> str:
    """The head node type the fake_multinode provider's autoscaler recognises.

    A constant of that provider's private module, not documented. Checked against Ray 2.60.0."""
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_TYPE

    return FAKE_HEAD_NODE_TYPE


def kuberay_autoscaling_config(ray_cluster: dict) -> dict:
    """The autoscaler config Ray's in-tree autoscaler derives from a KubeRay RayCluster resource
    (node types, their resources and worker limits), validated against ray-schema.json.

    Only the autoscaler running in the cluster does this; no public API exposes it. Checked against
    Ray 2.60.0."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    return _derive_autoscaling_config_from_ray_cr(ray_cluster)


def ray_address_file() -> str:
    """The file in which `ray start --head` records this machine's current cluster (the one a later
    ray.init() without an address joins).

    No public API names it; `ray stop` removes it but also stops every Ray process of the machine.
    Checked against Ray 2.60.0."""
    from ray._common.utils import get_ray_address_file

    return get_ray_address_file(None)
