"""`raytrain-par cluster validate`: cluster files checked offline, before they cost anything.

Two kinds of file live in clusters/:

- Ray cluster-launcher YAMLs (`ray up`): merged with Ray's defaults and checked by Ray itself
  (`prepare_config`, then `validate_config`: ray-schema.json and its cross-field rules).
- KubeRay manifests (RayCluster, RayJob): their structure (apiVersion, kind, head and worker group
  specs, container resources, autoscaling on), then Ray's own translation of the cluster spec into
  the config its in-tree autoscaler reads, validated the same way.

On top of what Ray checks, for both: every worker type's min_workers <= max_workers (Ray leaves
that to the autoscaler at run time), no Ray port open to the whole internet, token auth not
switched off, no credentials written into the file, and, given experiment files, whether the node
types can hold every experiment's (and sweep trial's) workers.

Every problem names the file, the field, the value and the fix, as experiment errors do.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from .errors import ConfigError, UserError

# Ray's ports that must never face the internet: dashboard + job API, GCS, Ray client.
RAY_PORTS = {8265: "dashboard and job API", 6379: "GCS", 10001: "Ray client"}
WORLD = ("0.0.0.0/0", "::/0")
KUBERAY_API = "ray.io/v1"
CLUSTER_SUFFIXES = (".yaml", ".yml")
# Every top-level field of a launcher config (what Ray's per-provider defaults files fill in).
FULL_CONFIG_KEYS = ("cluster_name", "max_workers", "upscaling_speed", "idle_timeout_minutes", "provider",
                    "available_node_types", "head_node_type", "auth", "docker", "file_mounts",
                    "cluster_synced_files", "file_mounts_sync_continuously", "rsync_exclude", "rsync_filter",
                    "initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                    "head_start_ray_commands", "worker_start_ray_commands")


@dataclass
class NodeType:
    name: str
    resources: dict[str, float]
    min_workers: int
    max_workers: int
    head: bool = False
    instance: str | None = None  # the cloud machine type its node_config names (InstanceType, machineType)
    spot: bool = False  # launched as spot / preemptible capacity

    def describe(self) -> str:
        res = ", ".join(f"{int(v) if float(v).is_integer() else v} {k}" for k, v in self.resources.items()
                        if k in ("CPU", "GPU"))
        count = "head" if self.head else f"{self.min_workers}-{self.max_workers} nodes"
        return f"{self.name} ({res or 'resources not declared'}; {count})"


@dataclass
class ClusterFile:
    path: Path
    kind: str = "?"
    node_types: list[NodeType] = field(default_factory=list)
    max_workers: int = 0  # all worker nodes together
    problems: list[ConfigError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, field_: str, value: Any, problem: str, fix: str) -> None:
        self.problems.append(ConfigError(field_, _short(value), problem, fix, source=str(self.path)))


def default_files(root: Path | None = None) -> list[Path]:
    root = Path(root or "clusters")
    files = sorted(p for p in root.glob("*") if p.suffix in CLUSTER_SUFFIXES) if root.is_dir() else []
    if not files:
        raise UserError(f"no cluster files (*.yaml) in {root.resolve()}.\n"
                        "  fix: run from the repository root, or name the files: raytrain-par cluster validate FILE ...")
    return files


def validate(paths: Iterable[str | Path], experiments: Iterable[str | Path] = ()) -> list[ClusterFile]:
    """Check every cluster file, and every experiment against every cluster file."""
    from .config import load_experiment

    specs = []
    for e in experiments:  # bad experiment files are the user's first problem: raise at once
        specs.append((str(e), load_experiment(e, check_data=False)))
    results = []
    for path in paths:
        cluster = check_file(Path(path))
        if cluster.ok:
            for source, spec in specs:
                check_capacity(cluster, spec, source)
        results.append(cluster)
    return results


def check_file(path: Path) -> ClusterFile:
    cluster = ClusterFile(path)
    if not path.is_file():
        cluster.problem("file", str(path), "no such file", "give the path of a cluster YAML, e.g. clusters/aws-a100.yaml")
        return cluster
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        cluster.problem("file", str(path), f"not valid YAML at {where}: {getattr(e, 'problem', e)}",
                        "fix the YAML syntax there (indentation, a missing ':' or quote)")
        return cluster
    if len(docs) != 1:
        cluster.problem("file", f"{len(docs)} YAML documents", "expected one: a cluster-launcher config or one "
                        "KubeRay resource", "keep one cluster (or one RayJob) per file")
        return cluster
    if not isinstance(docs[0], dict):
        cluster.problem("file", docs[0], "not a mapping of keys to values", "start from one of the files in clusters/")
        return cluster
    doc = docs[0]
    if "apiVersion" in doc or "kind" in doc:
        _check_kuberay(cluster, doc)
    elif "provider" in doc or "cluster_name" in doc:
        _check_launcher(cluster, doc)
    else:
        cluster.problem("file", list(doc)[:5], "neither a Ray cluster-launcher config (no `provider`) nor a KubeRay "
                        "manifest (no `apiVersion`/`kind`)", "start from one of the files in clusters/")
        return cluster
    _check_secrets(cluster, doc)
    return cluster


# -- cluster-launcher YAMLs ---------------------------------------------------------------------

def _check_launcher(cluster: ClusterFile, raw: dict) -> None:
    import jsonschema

    from .ray_private import prepare_config, validate_config

    provider = raw.get("provider")
    if not isinstance(provider, dict) or not isinstance(provider.get("type"), str):
        cluster.problem("provider.type", provider, "missing: Ray needs to know which cloud launches the nodes",
                        "add `provider: {type: aws, region: ...}` (or gcp, fake_multinode, ...)")
        return
    ptype = provider["type"]
    cluster.kind = f"cluster launcher ({ptype})"
    # Checked before Ray's rules, which reject a min_workers sum over max_workers first and would
    # hide which node type is wrong.
    for name, t in (raw.get("available_node_types") or {}).items():
        lo, hi = (t or {}).get("min_workers"), (t or {}).get("max_workers")
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            cluster.problem(f"available_node_types.{name}.min_workers", lo, f"larger than max_workers ({hi})",
                            f"lower min_workers to at most {hi}, or raise max_workers")
    if ptype == "fake_multinode":
        # Ray's wheel does not ship this provider's defaults file (prepare_config would fail to open
        # it): such files are written out in full and validated as they are.
        missing = [k for k in FULL_CONFIG_KEYS if k not in raw]
        for k in missing:
            cluster.problem(k, None, "missing: the fake_multinode provider has no defaults to fill it in",
                            "add it (see clusters/local-autoscale.yaml for every field)")
        if missing:
            return
    # Ray's config helpers log every default they fill in; the findings are what matter here.
    logging.getLogger("ray.autoscaler").setLevel(logging.WARNING)
    try:
        if ptype == "fake_multinode":
            config = copy.deepcopy(raw)
        else:
            config = prepare_config(copy.deepcopy(raw))
        validate_config(config)
    except jsonschema.ValidationError as e:
        path = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        value = e.instance
        if e.validator == "additionalProperties" and isinstance(e.instance, dict):
            extra = [k for k in e.instance if k not in e.schema.get("properties", {})]
            if extra:
                path, value = (f"{path}.{extra[0]}" if e.absolute_path else extra[0]), e.instance[extra[0]]
        cluster.problem(path, value, f"Ray's cluster schema: {e.message}", _schema_fix(e, path))
        return
    except NotImplementedError as e:  # _get_default_config: "Unsupported node provider"
        cluster.problem("provider.type", ptype, str(e), "use aws, gcp, azure, kuberay or fake_multinode")
        return
    except (ValueError, RuntimeError, KeyError, TypeError, AssertionError) as e:
        message = str(e).strip("'") or type(e).__name__
        fieldname = next((f for f in ("head_node_type", "max_workers", "docker", "available_node_types")
                          if f in message), "(file)")
        cluster.problem(fieldname, raw.get(fieldname) if fieldname in raw else None, f"Ray's config check: {message}",
                        _ray_fix(fieldname, raw))
        return

    if cluster.problems:
        return
    head_type = config.get("head_node_type")
    if ptype == "fake_multinode":
        from .ray_private import fake_multinode_head_type

        fake_head = fake_multinode_head_type()
        if head_type != fake_head:
            cluster.problem("head_node_type", head_type, f"the fake_multinode provider names its head node type "
                            f"{fake_head!r}; the autoscaler would not recognise the head",
                            f"rename the head node type to {fake_head}")
    for name, t in config.get("available_node_types", {}).items():
        head = name == head_type
        lo, hi = t.get("min_workers", 0), t.get("max_workers", 0 if head else config.get("max_workers", 0))
        node = t.get("node_config") or {}
        instance = node.get("InstanceType") or node.get("machineType")
        scheduling = node.get("scheduling") or {}
        spot = bool(node.get("InstanceMarketOptions")) or scheduling.get("provisioningModel") == "SPOT" \
            or bool(scheduling.get("preemptible"))
        cluster.node_types.append(NodeType(name, dict(t.get("resources", {})), lo, hi, head,
                                           instance if isinstance(instance, str) else None, spot))
    cluster.max_workers = config.get("max_workers", sum(t.max_workers for t in cluster.node_types))
    _check_security_group(cluster, provider)
    for key in ("head_start_ray_commands", "worker_start_ray_commands", "setup_commands"):
        for i, cmd in enumerate(config.get(key) or []):
            if re.search(r"RAY_AUTH_MODE=disabled", str(cmd)):
                cluster.problem(f"{key}[{i}]", cmd, "switches Ray's token auth off: anyone who reaches the "
                                "cluster could run code on it", "remove RAY_AUTH_MODE=disabled (use RAY_AUTH_MODE=token)")


def _schema_fix(e, path: str) -> str:
    if e.validator == "type":
        want = e.validator_value if isinstance(e.validator_value, str) else " or ".join(e.validator_value)
        return f"write {path} as {want}"
    if e.validator == "additionalProperties":
        allowed = sorted(e.schema.get("properties", {}))
        return "remove the unexpected key (a typo?)" + (f"; allowed here: {', '.join(allowed)}" if allowed else "")
    if e.validator == "required":
        return f"add the missing key under {path}"
    if e.validator in ("minimum", "maximum"):
        return f"use a value {'>=' if e.validator == 'minimum' else '<='} {e.validator_value}"
    if e.validator == "enum":
        return f"use one of: {', '.join(map(str, e.validator_value))}"
    return "see https://docs.ray.io/en/latest/cluster/vms/references/ray-cluster-configuration.html"


def _ray_fix(fieldname: str, raw: dict) -> str:
    types = list((raw.get("available_node_types") or {}))
    if fieldname == "head_node_type":
        return f"set head_node_type to one of the node types: {', '.join(types) or '(none defined)'}"
    if fieldname == "max_workers":
        return "raise max_workers to at least the sum of every node type's min_workers"
    return "see https://docs.ray.io/en/latest/cluster/vms/references/ray-cluster-configuration.html"


def _check_security_group(cluster: ClusterFile, provider: dict) -> None:
    """AWS: extra inbound rules of the security group Ray creates (provider.security_group)."""
    rules = (provider.get("security_group") or {}).get("IpPermissions") or []
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict):
            continue
        ranges = [r.get("CidrIp") for r in rule.get("IpRanges", []) or []]
        ranges += [r.get("CidrIpv6") for r in rule.get("Ipv6Ranges", []) or []]
        if not any(r in WORLD for r in ranges):
            continue
        lo, hi = rule.get("FromPort", -1), rule.get("ToPort", -1)
        all_ports = str(rule.get("IpProtocol")) == "-1" or lo in (-1, None)
        for port, what in RAY_PORTS.items():
            if all_ports or (lo is not None and hi is not None and lo <= port <= hi):
                cluster.problem(f"provider.security_group.IpPermissions[{i}]", rule,
                                f"opens port {port} ({what}) to the whole internet",
                                "remove the rule: reach the dashboard and job API through an SSH tunnel "
                                "(`ray dashboard FILE`), or limit CidrIp to your own address range")
                break


# -- KubeRay manifests --------------------------------------------------------------------------

def _check_kuberay(cluster: ClusterFile, doc: dict) -> None:
    kind, api = doc.get("kind"), doc.get("apiVersion")
    cluster.kind = f"KubeRay {kind}"
    if kind not in ("RayCluster", "RayJob"):
        cluster.problem("kind", kind, "not a KubeRay RayCluster or RayJob", "set kind: RayCluster (or RayJob)")
        return
    if api != KUBERAY_API:
        cluster.problem("apiVersion", api, f"{kind} is served as {KUBERAY_API} (v1alpha1 is gone since KubeRay 1.0)",
                        f"set apiVersion: {KUBERAY_API}")
    name = (doc.get("metadata") or {}).get("name")
    if not name:
        cluster.problem("metadata.name", name, "missing", f"name the {kind}, e.g. metadata: {{name: raytrain-par}}")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        cluster.problem("spec", spec, "missing or not a mapping", f"add the {kind} spec")
        return
    prefix = "spec"
    if kind == "RayJob":
        if not isinstance(spec.get("entrypoint"), str) or not spec["entrypoint"].strip():
            cluster.problem("spec.entrypoint", spec.get("entrypoint"), "missing: the command the job runs",
                            "e.g. entrypoint: raytrain-par run experiments/paper/gpt2-medium-wikitext.yaml ...")
        if spec.get("shutdownAfterJobFinishes") is not True:
            cluster.notes.append("spec.shutdownAfterJobFinishes is not true: the head pod stays up after the job")
        prefix, spec = "spec.rayClusterSpec", spec.get("rayClusterSpec")
        if not isinstance(spec, dict):
            cluster.problem(prefix, spec, "missing: the RayJob creates its cluster from it",
                            "add rayClusterSpec (or clusterSelector for an existing RayCluster)")
            return
    before = len(cluster.problems)
    _check_cluster_spec(cluster, spec, prefix)
    if len(cluster.problems) > before:
        return  # Ray's translation would only fail on the same problems, less clearly
    from .ray_private import kuberay_autoscaling_config

    try:
        # What the in-tree autoscaler reads from the RayCluster, validated against ray-schema.json.
        config = kuberay_autoscaling_config(
            {"metadata": {"name": name or "raycluster", "namespace": "default"}, "spec": spec})
    except Exception as e:  # noqa: BLE001 — any failure of Ray's translation is a problem of the file
        cluster.problem(prefix, "(cluster spec)", f"Ray's autoscaler cannot read it: {e}",
                        "give every group's Ray container cpu/memory limits and the group min/max replicas")
        return
    head_type = config["head_node_type"]
    for tname, t in config["available_node_types"].items():
        cluster.node_types.append(NodeType(tname, dict(t["resources"]), t["min_workers"], t["max_workers"],
                                           tname == head_type))
    cluster.max_workers = config["max_workers"]


def _check_cluster_spec(cluster: ClusterFile, spec: dict, prefix: str) -> None:
    if spec.get("enableInTreeAutoscaling") is not True:
        cluster.problem(f"{prefix}.enableInTreeAutoscaling", spec.get("enableInTreeAutoscaling"),
                        "autoscaling is off: worker groups stay at their replica count",
                        f"set {prefix}.enableInTreeAutoscaling: true")
    ray_version = spec.get("rayVersion")
    if not ray_version:
        cluster.problem(f"{prefix}.rayVersion", ray_version, "missing (KubeRay uses it to pick features)",
                        "set rayVersion to the Ray version of the image, e.g. '2.60.0'")
    auth = (spec.get("authOptions") or {}).get("mode")
    head = spec.get("headGroupSpec")
    if not isinstance(head, dict):
        cluster.problem(f"{prefix}.headGroupSpec", head, "missing", "add a headGroupSpec with a pod template")
        return
    head_container = _container(cluster, head, f"{prefix}.headGroupSpec", ray_version)
    env_auth = {e.get("name"): e.get("value") for e in (head_container or {}).get("env", []) or []
                if isinstance(e, dict)}.get("RAY_AUTH_MODE")
    if auth != "token" and env_auth != "token":
        cluster.problem(f"{prefix}.authOptions.mode", auth, "Ray's token auth is off: anyone who reaches the "
                        "head's ports could run code on the cluster",
                        f"set {prefix}.authOptions: {{mode: token}} (KubeRay >= 1.5.1)")
    service_type = head.get("serviceType") or ((head.get("headService") or {}).get("spec") or {}).get("type")
    if service_type in ("LoadBalancer", "NodePort"):
        cluster.problem(f"{prefix}.headGroupSpec.serviceType", service_type,
                        "exposes the head's dashboard (8265), GCS (6379) and client (10001) ports outside "
                        "the Kubernetes cluster", "leave serviceType out (ClusterIP) and reach the dashboard "
                        "with `kubectl port-forward service/<name>-head-svc 8265:8265`")
    groups = spec.get("workerGroupSpecs")
    if not isinstance(groups, list) or not groups:
        cluster.problem(f"{prefix}.workerGroupSpecs", groups, "no worker groups: nothing to scale",
                        "add a worker group with minReplicas/maxReplicas and GPU limits")
        return
    for i, g in enumerate(groups):
        where = f"{prefix}.workerGroupSpecs[{i}]"
        if not isinstance(g, dict):
            cluster.problem(where, g, "not a mapping", "write the group as `groupName: ...` lines")
            continue
        if not g.get("groupName"):
            cluster.problem(f"{where}.groupName", g.get("groupName"), "missing", "name the group, e.g. gpu-a100")
        lo, hi = g.get("minReplicas"), g.get("maxReplicas")
        for key, v in (("minReplicas", lo), ("maxReplicas", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                cluster.problem(f"{where}.{key}", v, "must be an integer >= 0 (the autoscaler's bounds)",
                                f"set {key}, e.g. 0 and 8")
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            cluster.problem(f"{where}.minReplicas", lo, f"larger than maxReplicas ({hi})",
                            f"lower minReplicas to at most {hi}, or raise maxReplicas")
        _container(cluster, g, where, ray_version)


def _container(cluster: ClusterFile, group: dict, where: str, ray_version) -> dict | None:
    containers = (((group.get("template") or {}).get("spec") or {}).get("containers"))
    if not isinstance(containers, list) or not containers or not isinstance(containers[0], dict):
        cluster.problem(f"{where}.template.spec.containers", containers, "no Ray container",
                        "add the pod template with the Ray container first in `containers`")
        return None
    c = containers[0]
    image = c.get("image")
    if not image:
        cluster.problem(f"{where}.template.spec.containers[0].image", image, "missing", "set the image")
    elif ray_version and str(image).startswith("rayproject/ray:") and not str(image).split(":", 1)[1].startswith(
            str(ray_version)):
        cluster.problem(f"{where}.template.spec.containers[0].image", image,
                        f"its Ray version differs from rayVersion {ray_version}", "use the same Ray version in both")
    limits = (c.get("resources") or {}).get("limits") or {}
    for key in ("cpu", "memory"):
        if key not in limits:
            cluster.problem(f"{where}.template.spec.containers[0].resources.limits.{key}", None,
                            "missing: Kubernetes would not reserve it and the autoscaler cannot plan with it",
                            f"set limits.{key} (and the same requests)")
    return c


# -- both ---------------------------------------------------------------------------------------

_SECRET_KEYS = re.compile(r"(aws_secret_access_key|aws_access_key_id|gcp_credentials|password|secret_key)$", re.I)
_AWS_KEY = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")


def _check_secrets(cluster: ClusterFile, doc: Any, path: str = "") -> None:
    """Credentials come from the environment (cloud CLIs' profiles, Kubernetes Secrets), never the file."""
    if isinstance(doc, dict):
        if isinstance(doc.get("name"), str) and "value" in doc and re.search(r"TOKEN|SECRET|PASSWORD|_KEY$",
                                                                              doc["name"], re.I):
            cluster.problem(f"{path}.value", "(hidden)", f"environment variable {doc['name']} is written into the "
                            "file", "read it from a Secret: valueFrom: {secretKeyRef: {name: ..., key: ...}}")
        for k, v in doc.items():
            sub = f"{path}.{k}" if path else str(k)
            if _SECRET_KEYS.search(str(k)) and v:
                cluster.problem(sub, "(hidden)", "a credential written into the cluster file",
                                "remove it: the cloud CLI's own credentials (environment, profile) are used")
            else:
                _check_secrets(cluster, v, sub)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            _check_secrets(cluster, v, f"{path}[{i}]")
    elif isinstance(doc, str) and _AWS_KEY.search(doc):
        cluster.problem(path, "(hidden)", "holds an AWS access key id", "remove it; credentials come from the environment")


# -- the accelerators a cluster rents ----------------------------------------------------------------

@dataclass(frozen=True)
class GpuNodes:
    """The GPU machines a cluster file launches: what `estimate --cluster` predicts on."""

    path: Path
    node_type: str
    instance: str | None  # the cloud machine type (None: the file does not say, as a KubeRay group)
    gpus_per_node: int
    max_gpus: int  # at its max_workers (and the cluster's)
    spot_also: bool = False  # the same machines are offered as spot capacity too

    def too_small_for(self, workers: int) -> str | None:
        """Why `workers` GPUs do not fit on these machines, or None."""
        if workers <= self.max_gpus:
            return None
        nodes = self.max_gpus // self.gpus_per_node
        return f"{self.path} holds at most {self.max_gpus} GPUs ({nodes} x {self.node_type})"


def gpu_nodes(path: str | Path) -> GpuNodes:
    """The one GPU machine type of a cluster file (its on-demand node type; a spot type of the same machine
    beside it is the same hardware). Raises UserError for a file with problems, or with no or several GPU
    machine types."""
    cluster = check_file(Path(path))
    if not cluster.ok:
        raise UserError(f"--cluster {path}: {cluster.problems[0]}\n  (`raytrain-par cluster validate {path}` lists "
                        "every problem)")
    gpu = [t for t in cluster.node_types if not t.head and t.resources.get("GPU", 0) > 0]
    if not gpu:
        raise UserError(f"--cluster {path}: no node type with GPUs.\n  fix: a cluster file with a GPU worker type "
                        "(clusters/aws-a100.yaml, aws-v100.yaml, gcp-a100.yaml)")
    machines = {(t.instance, t.resources["GPU"]) for t in gpu}
    if len(machines) > 1:
        named = ", ".join(f"{t.name} ({t.instance or 'machine not named'}, {t.resources['GPU']:g} GPUs)" for t in gpu)
        raise UserError(f"--cluster {path}: its GPU node types are different machines ({named}); a prediction is "
                        "for one.\n  fix: a cluster file with one GPU machine type, or --device NAME --price USD")
    chosen = next((t for t in gpu if not t.spot), gpu[0])
    per_node = int(chosen.resources["GPU"])
    nodes = min(chosen.max_workers, cluster.max_workers or chosen.max_workers)
    return GpuNodes(Path(path), chosen.name, chosen.instance, per_node, nodes * per_node,
                    spot_also=any(t.spot for t in gpu) and not chosen.spot)


# -- capacity -----------------------------------------------------------------------------------

def check_capacity(cluster: ClusterFile, spec, source: str) -> None:
    """Can the cluster's node types, at their max_workers, hold the workers of the experiment and of
    every trial of its sweep? A worker must fit on one node (its CPUs, and GPUs with use_gpu)."""
    from .sweep import describe, plan

    trials = [(None, spec)]
    if spec.sweep:
        p = plan(spec)
        trials = [(describe(pt), p.trial_spec(pt)) for pt in p.points]
    seen = set()
    for label, t in sorted(trials, key=lambda lt: -lt[1].scaling.num_workers):
        s = t.scaling
        key = (s.num_workers, s.cpus_per_worker, s.gpus_per_worker if s.use_gpu else 0)
        if key in seen:
            continue
        seen.add(key)
        problem = _fit(cluster, s)
        if problem:
            trial = f" (trial {label})" if label and problem[0] != "scaling.use_gpu" else ""
            where = f"{source}{trial} on {cluster.path}"
            cluster.problems.append(ConfigError(*problem, source=where))
            return  # the largest trial that does not fit says it; smaller ones would repeat it


def _fit(cluster: ClusterFile, s) -> tuple | None:
    need = {"CPU": s.cpus_per_worker}
    if s.use_gpu:
        need["GPU"] = s.gpus_per_worker
    gpu_types = [t for t in cluster.node_types if t.resources.get("GPU", 0) > 0]
    if s.use_gpu and not gpu_types:
        return ("scaling.use_gpu", True, f"{cluster.path} has no node type with GPUs",
                "use a cluster file with a GPU worker type (clusters/aws-a100.yaml, aws-v100.yaml, gcp-a100.yaml, "
                "kuberay-raycluster.yaml), or set scaling.use_gpu: false")

    def per_node(t: NodeType) -> int:
        """Workers of this experiment one node of type t holds."""
        return min((math.floor(t.resources.get(k, 0) / v + 1e-9) for k, v in need.items() if v > 0),
                   default=s.num_workers)

    if all(per_node(t) == 0 for t in cluster.node_types):
        for k, v in need.items():
            most = max((t.resources.get(k, 0) for t in cluster.node_types), default=0)
            if v > most:
                key = f"scaling.{k.lower()}s_per_worker"
                return (key, v, f"no node type of {cluster.path} has {v:g} {k}s (the most on one node: {most:g})",
                        f"lower {key} to {most:g} or less, or add a larger node type")
        return ("scaling", f"{need}", f"no single node type of {cluster.path} has both the CPUs and the GPUs of "
                "one worker", "give the GPU node type enough CPUs (resources: {CPU: ..., GPU: ...})")
    capacity, left, used = 0, cluster.max_workers, []
    for t in sorted(cluster.node_types, key=per_node, reverse=True):
        if not per_node(t):
            continue
        n = 1 if t.head else min(t.max_workers, left)
        left -= 0 if t.head else n
        if n:
            capacity += per_node(t) * n
            used.append(f"{n} x {t.name} ({per_node(t)} each)")
    if capacity < s.num_workers:
        fix = "use fewer workers (scaling.num_workers)"
        best = max((t for t in cluster.node_types if not t.head), key=per_node, default=None)
        if best is not None and per_node(best):
            nodes = math.ceil(s.num_workers / per_node(best))
            bound = (f"maxReplicas of worker group {best.name}" if cluster.kind.startswith("KubeRay")
                     else f"available_node_types.{best.name}.max_workers (and max_workers)")
            fix = f"raise {bound} to {nodes} in {cluster.path}, or {fix}"
        return ("scaling.num_workers", s.num_workers,
                f"{cluster.path} holds at most {capacity} such workers ({', '.join(used) or 'none fit'})", fix)
    return None


def _short(value: Any, limit: int = 120) -> Any:
    text = repr(value)
    return value if len(text) <= limit else text[:limit - 3] + "..."
