"""The devices `raytrain-par estimate --device NAME` predicts step times for: peak FLOP/s, memory and the
links between them, each figure with its source.

A device's figures are per accelerator: its dense matmul peak per dtype (NVIDIA's datasheets, as
metrics/flops.py reads them for the devices a run is on), its memory, and the bandwidth and latency one
accelerator gets to its peers inside a node (NVLink) and across nodes (its share of the node's
network adapters). Bandwidth is per direction: what a ring collective's bus bandwidth can approach.

`achievable` is the one figure per device that is not a datasheet's: the fraction of the peak a
training step's matmuls reach (MFU at best). `benchmarks/gpu_check.py` measures it where it runs on
a GPU and writes it to raytrain_par/achievable.json, which this catalogue reads first; then the
fraction `benchmarks/published.py` fits to published runs of that GPU (raytrain_par/fitted_achievable.json,
docs/published-runs.md); else each device carries the figure and source given below. The latencies
are assumptions of the order of NCCL's small-message collective times (no datasheet states one);
every figure can be overridden on the command line (`--set-device FIELD=VALUE`), and a cluster
file's machine type sets the GPUs per node and the network (`INSTANCES`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import NamedTuple

from .errors import UserError

GB = 1e9  # bandwidths in GB/s as the datasheets give them (10^9 bytes)
GIB = 2**30
US = 1e-6

#: where `benchmarks/gpu_check.py` writes each device's measured achievable fraction (in the package: an
#: installed copy reads what the checkout measured)
ACHIEVABLE_FILE = Path(__file__).resolve().parent / "achievable.json"
#: where `benchmarks/published.py` writes the fraction fitted to published runs of each GPU (docs/published-runs.md):
#: taken where no GPU here has measured one
FITTED_FILE = Path(__file__).resolve().parent / "fitted_achievable.json"


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: dict[str, float]  # dense, per dtype: bf16, fp16, tf32, fp32
    memory_bytes: float
    intra_node_bw: float  # bytes/s per direction, one accelerator to its node's others
    inter_node_bw: float  # bytes/s per direction, one accelerator's share of the node's network
    intra_node_latency_s: float
    inter_node_latency_s: float
    gpus_per_node: int
    achievable: float  # fraction of the peak a training step's matmuls reach
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # whether collectives run beside the computation (a GPU's NCCL kernels and copy engines) rather than
    # on the cores that compute (gloo on a CPU): what computation can hide (metrics/steptime.py)
    overlaps_communication: bool = True
    # each collective's time over the ring model's on this device's links (metrics/steptime.py), by op;
    # 1 where absent. NCCL's rings reach about one bus bandwidth whatever the op (nccl-tests), so the
    # catalogue's GPUs leave it empty; gloo's all-gather and reduce-scatter run slower than its all-reduce,
    # and this machine's are measured (measure_loopback).
    collective_factors: dict[str, float] = field(default_factory=dict, compare=False)
    # the share of a core each worker computes on while all of them compute, where they outnumber the
    # cores (this machine's CPU: cpu_workers); 1 where each has its own accelerator. Below 1, ranks
    # that wait leave their cores to those that compute (metrics/steptime.py: the pipeline's bubble).
    cores_share: float = 1.0
    # seconds each step takes beyond its FLOPs at the achievable rate, whatever its batch: the optimizer's
    # update, zeroing the gradients, each operator's dispatch. What `plan`'s probes at several batches fit
    # beside the achievable fraction on this machine (goodput.Calibrated); 0 in the catalogue, where no
    # run measured it (--set-device step_overhead_s=MS).
    step_overhead_s: float = 0.0

    def peak(self, precision: str) -> float:
        """FLOP/s of the dtype a run computes in: bf16/fp16 on the tensor cores, fp32 on the plain FP32
        units (the engines leave torch's float32 matmul precision at 'highest': no TF32)."""
        key = precision
        if key not in self.peak_tflops:
            raise UserError(f"--device {self.name}: has no {precision} peak (it computes in "
                            f"{', '.join(self.peak_tflops)}).\n  fix: train.precision {next(iter(self.peak_tflops))}, "
                            "or another --device")
        return self.peak_tflops[key] * 1e12

    def describe(self) -> str:
        peaks = ", ".join(f"{k} {v:g}" for k, v in self.peak_tflops.items())
        return (f"{self.name}: {peaks} TFLOP/s dense; {self.memory_bytes / GIB:.0f} GiB; "
                f"{self.intra_node_bw / GB:g} GB/s in a node of {self.gpus_per_node}, {self.inter_node_bw / GB:g} "
                f"GB/s across nodes; {self.achievable:.0%} of peak achievable")


_NVLINK = "NVLink's total bandwidth per GPU on the datasheet, halved: per direction"
_LATENCY = ("assumed: the order of NCCL's small-message collective time per ring step (no datasheet "
            "gives one); override with --set-device")

_V100 = Device("v100-32gb", {"fp16": 125, "fp32": 15.7}, 32 * GIB, 150 * GB, 6.25 * GB, 5 * US, 10 * US, 8, 0.3, {
    "peak_tflops": "NVIDIA V100 datasheet (SXM2): 125 TFLOP/s fp16 tensor, 15.7 fp32; no bf16",
    "memory_bytes": "NVIDIA V100 datasheet: 32 GB HBM2",
    "intra_node_bw": f"{_NVLINK}: 300 GB/s (NVLink 2)",
    "inter_node_bw": "NVIDIA DGX-1: 4 x 100 Gb/s EDR InfiniBand for 8 GPUs",
    "achievable": "Megatron-LM (Shoeybi et al. 2019): 39 TFLOP/s on one V100, 30% of its peak",
})
_A100 = Device("a100-40gb", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}, 40 * GIB, 300 * GB, 25 * GB,
               5 * US, 10 * US, 8, 0.52, {
                   "peak_tflops": "NVIDIA A100 datasheet (SXM4): 312 TFLOP/s bf16/fp16, 156 tf32, 19.5 fp32, dense",
                   "memory_bytes": "NVIDIA A100 datasheet: 40 GB HBM2",
                   "intra_node_bw": f"{_NVLINK}: 600 GB/s (NVLink 3)",
                   "inter_node_bw": "NVIDIA DGX A100: 8 x 200 Gb/s HDR InfiniBand for 8 GPUs",
                   "achievable": "Megatron-LM (Narayanan et al. SC21): 52% of the peak per A100 at 3072 GPUs",
               })
_H100 = Device("h100-sxm", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}, 80 * GIB, 450 * GB, 50 * GB,
               5 * US, 10 * US, 8, 0.4, {
                   "peak_tflops": "NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16/fp16, 494 tf32, 67 fp32, dense",
                   "memory_bytes": "NVIDIA H100 datasheet: 80 GB HBM3",
                   "intra_node_bw": f"{_NVLINK}: 900 GB/s (NVLink 4)",
                   "inter_node_bw": "NVIDIA DGX H100: 8 x 400 Gb/s NDR InfiniBand for 8 GPUs",
                   "achievable": "Llama 3 (Dubey et al. 2024): 38-43% MFU in bf16 on 8K-16K H100s; the middle",
               })


def _variant(base: Device, name: str, memory_gb: int, memory_source: str, **sources: str) -> Device:
    """`base`'s chip with another memory (and what else `sources` says differs)."""
    return replace(base, name=name, memory_bytes=memory_gb * GIB,
                   sources={**base.sources, "memory_bytes": memory_source, **sources})


CATALOGUE: dict[str, Device] = {d.name: d for d in [
    _V100, _variant(_V100, "v100-16gb", 16, "NVIDIA V100 datasheet: 16 GB HBM2"),
    _A100, _variant(_A100, "a100-80gb", 80, "NVIDIA A100 datasheet: 80 GB HBM2e"), _H100,
    _variant(_H100, "h200", 141, "NVIDIA H200 datasheet: 141 GB HBM3e",
             peak_tflops="NVIDIA H200 datasheet (SXM): 989 TFLOP/s bf16/fp16, 494 tf32, 67 fp32, dense (as H100)",
             inter_node_bw="NVIDIA DGX H200: 8 x 400 Gb/s NDR InfiniBand for 8 GPUs",
             achievable="assumed: as h100-sxm (the same compute units; more and faster memory)"),
]}
for _d in CATALOGUE.values():
    _d.sources.setdefault("intra_node_latency_s", _LATENCY)
    _d.sources.setdefault("inter_node_latency_s", _LATENCY)
    _d.sources.setdefault("gpus_per_node", "the NVIDIA DGX / HGX node of this GPU")

NAMES = (*CATALOGUE, "cpu")


def cpu() -> Device:
    """This machine: its matmul peak probed now (metrics/flops.py, fp32), its memory, and processes of one
    node exchanging tensors through gloo over the loopback."""
    import torch

    from .metrics.flops import probe_tflops

    tflops = probe_tflops(torch.device("cpu"), torch.float32)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device("cpu", {"fp32": tflops, "bf16": tflops}, memory, 1 * GB, 1 * GB, 50 * US, 50 * US,
                  os.cpu_count() or 1, 1.0, {
                      "peak_tflops": "probed here: the best of five fp32 matmuls (metrics/flops.py); bf16 taken "
                                     "as fp32 (CPUs have no faster 16-bit units torch uses)",
                      "memory_bytes": "this machine's physical memory",
                      "intra_node_bw": "assumed: gloo over the loopback, of the order of a memory copy per byte",
                      "inter_node_bw": "assumed: as inside the node",
                      "intra_node_latency_s": "assumed: gloo's per-message cost over the loopback",
                      "inter_node_latency_s": "assumed: as inside the node",
                      "gpus_per_node": "this machine's CPU cores: one worker each",
                      "achievable": "1: the probe is what this machine's matmuls reach",
                      "overlaps_communication": "no: gloo's collectives run on the cores that compute",
                  }, overlaps_communication=False)


#: bytes of the collectives that measure the loopback link
LINK_SIZES = [2**k for k in range(12, 25, 2)]
#: the ops whose time over the ring model's is measured beside the all-reduce (Device.collective_factors)
FACTOR_OPS = ("all_gather", "reduce_scatter")


def _collective_seconds(rank: int, world: int, sizes: list[int], repeats: int) -> dict[str, list[float]]:
    """Median seconds of a gloo all-reduce, all-gather and reduce-scatter of each size (the whole
    buffer: the all-gather's output, the reduce-scatter's input) between the ranks, by op, while a
    second thread of each rank multiplies matrices, as a training step's computation runs beside the
    collectives gloo's threads carry."""
    import threading

    import torch

    torch.set_num_threads(1)  # the rank's one compute thread, as a worker's
    stop, a = threading.Event(), torch.randn(256, 256)

    def compute():
        while not stop.is_set():
            a @ a

    thread = threading.Thread(target=compute, daemon=True)
    thread.start()
    try:
        return _timed_collectives(world, sizes, repeats)
    finally:
        stop.set()
        thread.join()


def _timed_collectives(world: int, sizes: list[int], repeats: int) -> dict[str, list[float]]:
    import statistics
    import time

    import torch
    import torch.distributed as dist

    def run(op, full, shard):
        if op == "all_reduce":
            dist.all_reduce(full)
        elif op == "all_gather":
            dist.all_gather_single(full, shard)
        else:
            dist.reduce_scatter_single(shard, full)

    out = {}
    for op in ("all_reduce", *FACTOR_OPS):
        out[op] = []
        for size in sizes:
            full, shard = torch.ones(size // 4), torch.ones(size // 4 // world)
            run(op, full, shard)
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                run(op, full, shard)
                times.append(time.perf_counter() - t0)
            out[op].append(statistics.median(times))
    return out


class Loopback(NamedTuple):
    """gloo between two processes of this machine, as measure_loopback measured it."""

    bandwidth: float  # bytes/s per direction
    latency_s: float  # a ring step
    factors: dict  # Device.collective_factors


def measure_loopback(repeats: int = 20) -> Loopback:
    """gloo between two processes of this machine: all-reduces of 4 KiB to 16 MiB, a least-squares line
    (a two-rank all-reduce takes B / bandwidth + 2 latency, as metrics/steptime.py's ring has it with
    n = 2); then all-gathers and reduce-scatters of the same sizes, each op's time over the ring model's
    on that link (the median over the sizes of 1 MiB and more, where bandwidth decides). A few seconds.

    Each process multiplies matrices on a second thread meanwhile. In a step
    gloo's threads share the cores with the computation (DDP's and FSDP's reductions run beside the
    backward pass, the other ranks compute while one communicates), and there its collectives take up
    to twice as long as between idle processes: on the idle link the prediction fell short of the
    measured step for every layout that communicates (docs/step-time-results.md)."""
    import numpy as np

    from .local_group import run_ranks
    from .metrics.comm import Collective
    from .metrics.steptime import Link, collective_seconds

    seconds = run_ranks(2, _collective_seconds, LINK_SIZES, repeats)[0]
    slope, intercept = np.polyfit(np.array(LINK_SIZES, dtype=float), np.array(seconds["all_reduce"]), 1)
    link = Link(float(1.0 / slope), float(max(intercept, 0.0) / 2))
    factors = {op: float(np.median([t / collective_seconds(Collective(op, size, 2), link)
                                    for size, t in zip(LINK_SIZES, seconds[op]) if size >= 2**20]))
               for op in FACTOR_OPS}
    return Loopback(link.bandwidth, link.latency_s, factors)


def cpu_workers(base: Device, link: tuple[float, float], workers: int, threads_per_worker: int = 1,
                background_cores: float = 0.0) -> Device:
    """`base` (this machine, `cpu()`, its peak that of `threads_per_worker` threads) with the loopback
    `link` measured, for `workers` processes: beyond the cores left to them (its cores less the
    `background_cores` its other processes keep busy) they share them, each computing at
    (cores - background) / (workers x threads) of its peak. gloo moves and sums the bytes on the same
    cores, so the link shares them too: its bandwidth at that share, each ring step's latency over it
    (`link` was measured with two processes, one core each). The step's overhead (Device.step_overhead_s)
    runs on the cores too: over the same share."""
    cores = max((os.cpu_count() or 1) - background_cores, 0.1)
    share = min(1.0, cores / (workers * threads_per_worker))
    bandwidth, latency = link[0] * share, link[1] / share
    return replace(base, peak_tflops={k: v * share for k, v in base.peak_tflops.items()}, intra_node_bw=bandwidth,
                   inter_node_bw=bandwidth, intra_node_latency_s=latency, inter_node_latency_s=latency,
                   gpus_per_node=max(workers, 1), collective_factors=dict(getattr(link, "factors", {})),
                   cores_share=share, step_overhead_s=base.step_overhead_s / share,
                   sources={**base.sources,
                            "intra_node_bw": "measured here: gloo all-reduces between two processes, each computing "
                                             "beside them; times the cores' share per worker",
                            "intra_node_latency_s": "measured here, as intra_node_bw: over the cores' share",
                            "collective_factors": "measured here: gloo's all-gathers and reduce-scatters"})


def measured_achievable() -> dict[str, dict]:
    """{device: {'achievable': fraction, 'source': ...}} as benchmarks/gpu_check.py wrote it, or {}."""
    return _entries(ACHIEVABLE_FILE)


def fitted_achievable() -> dict[str, dict]:
    """{device: {'achievable': fraction, 'source': ...}} as benchmarks/published.py fitted it, or {}."""
    return _entries(FITTED_FILE)


def _entries(path: Path) -> dict[str, dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def record_fitted(entries: dict[str, dict]) -> Path:
    """Write the fractions fitted to published runs (benchmarks/published.py), replacing the file."""
    FITTED_FILE.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    return FITTED_FILE


#: torch.cuda.get_device_name -> the catalogue's name, the more specific first
CUDA_NAMES = [(r"\bH200\b", "h200"), (r"\bH100\b(?!.*(PCIe|NVL))", "h100-sxm"), (r"\bA100\b.*80\s?GB", "a100-80gb"),
              (r"\bA100\b", "a100-40gb"), (r"\bV100\b.*32\s?GB", "v100-32gb")]


def catalogue_name(cuda_name: str) -> str | None:
    return next((name for pattern, name in CUDA_NAMES if re.search(pattern, cuda_name)), None)


def record_achievable(cuda_name: str, fraction: float, source: str) -> str | None:
    """Write the fraction of the peak measured on a GPU (benchmarks/gpu_check.py) for its catalogue entry,
    keeping the other devices'; returns the entry's name, or None for a GPU the catalogue lacks."""
    name = catalogue_name(cuda_name)
    if name is None:
        return None
    entries = measured_achievable()
    entries[name] = {"achievable": round(fraction, 4), "source": source}
    ACHIEVABLE_FILE.parent.mkdir(parents=True, exist_ok=True)
    ACHIEVABLE_FILE.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    return name


#: fields --set-device may override, and how a value is read
SCALES = {"memory_bytes": GIB, "intra_node_bw": GB, "inter_node_bw": GB, "intra_node_latency_s": US,
          "inter_node_latency_s": US, "step_overhead_s": 1e-3}
UNITS = {"memory_bytes": "GiB", "intra_node_bw": "GB/s", "inter_node_bw": "GB/s", "intra_node_latency_s": "us",
         "inter_node_latency_s": "us", "gpus_per_node": "", "achievable": "(fraction)", "step_overhead_s": "ms"}


def device(name: str, overrides: dict[str, str] | None = None, gpus_per_node: int | None = None) -> Device:
    """The catalogue's device `name` (the measured achievable fraction where there is one), with
    `overrides` ({field: value in UNITS}) and `gpus_per_node` applied."""
    if name == "cpu":
        d = cpu()
    elif name in CATALOGUE:
        d = CATALOGUE[name]
        measured = measured_achievable().get(name) or fitted_achievable().get(name)
        if measured:
            d = replace(d, achievable=float(measured["achievable"]),
                        sources={**d.sources, "achievable": measured.get("source", str(ACHIEVABLE_FILE))})
    else:
        raise UserError(f"--device {name!r}: not in the catalogue.\n  fix: one of {', '.join(NAMES)}, "
                        "with --set-device FIELD=VALUE for what differs")
    changes, sources = {}, dict(d.sources)
    for key, text in (overrides or {}).items():
        if key not in UNITS:
            raise UserError(f"--set-device {key}={text}: no such field.\n  fix: one of {', '.join(UNITS)}")
        try:
            value = float(text)
        except ValueError:
            raise UserError(f"--set-device {key}={text}: not a number.\n  fix: a number in {UNITS[key] or 'units'}, "
                            f"e.g. {key}=8") from None
        if (value < 0 if key == "step_overhead_s" else value <= 0) or (key == "achievable" and value > 1):
            wanted = {"achievable": "a fraction in (0, 1]", "step_overhead_s": "a number of milliseconds, 0 or more"}
            raise UserError(f"--set-device {key}={text}: out of range.\n  fix: {wanted.get(key, 'a positive number')}")
        changes[key] = int(value) if key == "gpus_per_node" else value * SCALES.get(key, 1)
        sources[key] = "given on the command line"
    if gpus_per_node is not None:
        changes["gpus_per_node"] = gpus_per_node
        sources["gpus_per_node"] = "given on the command line"
    return replace(d, **changes, sources=sources)


@dataclass(frozen=True)
class Instance:
    """A cloud machine type a cluster file's node type names (`InstanceType` on AWS, `machineType` on
    GCP): which accelerators it holds, its network and its price. The network is the node's, shared by
    its accelerators; the catalogue's device figures assume NVIDIA's DGX nodes, and cloud nodes often
    have less."""

    name: str
    device: str  # the catalogue's name of its accelerator
    gpus: int
    network_gbps: float  # the node's network adapters together, Gb/s
    usd_per_hour: float  # the whole node, on demand
    source: str

    @property
    def usd_per_gpu_hour(self) -> float:
        return self.usd_per_hour / self.gpus


_AWS = ("AWS EC2 on-demand list price, us-east-1, 2024 (AWS lowered P4 and P5 prices in 2025, and spot "
        "capacity costs less: give yours with --price); GPUs and network from the instance type's page")
_GCP = "Google Cloud on-demand list price, us-central1, 2024 (give yours with --price); GPUs and network from its page"
INSTANCES: dict[str, Instance] = {i.name: i for i in [
    Instance("p3.16xlarge", "v100-16gb", 8, 25, 24.48, _AWS),
    Instance("p3dn.24xlarge", "v100-32gb", 8, 100, 31.212, _AWS),
    Instance("p4d.24xlarge", "a100-40gb", 8, 400, 32.7726, _AWS),
    Instance("p4de.24xlarge", "a100-80gb", 8, 400, 40.9657, _AWS),
    Instance("p5.48xlarge", "h100-sxm", 8, 3200, 98.32, _AWS),
    Instance("a2-highgpu-8g", "a100-40gb", 8, 100, 29.387, _GCP),
]}


def instance_device(instance: Instance, overrides: dict[str, str] | None = None) -> Device:
    """The device of one accelerator of `instance`: the catalogue's chip in the instance's node (its GPU
    count, its network shared by them), then `overrides` as --set-device gives them."""
    node = {"gpus_per_node": str(instance.gpus), "inter_node_bw": str(instance.network_gbps / 8 / instance.gpus)}
    d = device(instance.device, {**node, **(overrides or {})})
    sources = dict(d.sources)
    for key in node:
        if key not in (overrides or {}):
            sources[key] = (f"{instance.name}: {instance.gpus} GPUs and {instance.network_gbps:g} Gb/s of network "
                            "per node, shared by its GPUs")
    return replace(d, sources=sources)


def cluster_device(path: str, overrides: dict[str, str] | None = None):
    """(device, USD per GPU-hour, clusters.GpuNodes) of a cluster file's GPU machine type."""
    from .clusters import gpu_nodes

    nodes = gpu_nodes(path)
    if nodes.instance is None:
        raise UserError(f"--cluster {path}: node type {nodes.node_type} does not name its machine (a KubeRay group's "
                        "pods do not), so its GPU and price are unknown.\n  fix: --device NAME (one of "
                        f"{', '.join(CATALOGUE)}) --gpus-per-node {nodes.gpus_per_node} --price USD_PER_GPU_HOUR")
    instance = INSTANCES.get(nodes.instance)
    if instance is None:
        raise UserError(f"--cluster {path}: machine type {nodes.instance!r} (node type {nodes.node_type}) is not one "
                        f"raytrain-par knows ({', '.join(INSTANCES)}).\n  fix: --device NAME --gpus-per-node "
                        f"{nodes.gpus_per_node} --set-device inter_node_bw=GB_PER_S --price USD_PER_GPU_HOUR")
    if instance.gpus != nodes.gpus_per_node:
        raise UserError(f"--cluster {path}: node type {nodes.node_type} declares {nodes.gpus_per_node} GPUs, and a "
                        f"{instance.name} has {instance.gpus}.\n  fix: resources: {{GPU: {instance.gpus}}} in "
                        f"available_node_types.{nodes.node_type}")
    return instance_device(instance, overrides), instance.usd_per_gpu_hour, nodes


def field_names() -> list[str]:
    return [f.name for f in fields(Device)]
