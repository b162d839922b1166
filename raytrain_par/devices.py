"""The devices `raytrain-par estimate --device NAME` predicts step times for: peak FLOP/s, memory and the
links between them, each figure with its source.

A device's figures are per accelerator: its dense matmul peak per dtype (NVIDIA's datasheets, as
metrics/flops.py reads them for the devices a run is on), its memory, and the bandwidth and latency one
accelerator gets to its peers inside a node (NVLink) and across nodes (its share of the node's
network adapters). Bandwidth is per direction: what a ring collective's bus bandwidth can approach.

`achievable` is the one figure per device that is not a datasheet's: the fraction of the peak a
training step's matmuls reach (MFU at best). `benchmarks/gpu_check.py` measures it where it runs on
a GPU and writes it to raytrain_par/achievable.json, which this catalogue reads; until then
each device carries the figure and source given below. The latencies are assumptions of the order
of NCCL's small-message collective times (no datasheet states one); every figure can be overridden
on the command line (`--set-device FIELD=VALUE`) or by a cluster file's node type.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .errors import UserError

GB = 1e9  # bandwidths in GB/s as the datasheets give them (10^9 bytes)
GIB = 2**30
US = 1e-6

#: where `benchmarks/gpu_check.py` writes each device's measured achievable fraction (in the package: an
#: installed copy reads what the checkout measured)
ACHIEVABLE_FILE = Path(__file__).resolve().parent / "achievable.json"


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
    _V100, _A100, _variant(_A100, "a100-80gb", 80, "NVIDIA A100 datasheet: 80 GB HBM2e"), _H100,
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


def measured_achievable() -> dict[str, dict]:
    """{device: {'achievable': fraction, 'source': ...}} as benchmarks/gpu_check.py wrote it, or {}."""
    try:
        return json.loads(ACHIEVABLE_FILE.read_text())
    except (OSError, ValueError):
        return {}


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
          "inter_node_latency_s": US}
UNITS = {"memory_bytes": "GiB", "intra_node_bw": "GB/s", "inter_node_bw": "GB/s", "intra_node_latency_s": "us",
         "inter_node_latency_s": "us", "gpus_per_node": "", "achievable": "(fraction)"}


def device(name: str, overrides: dict[str, str] | None = None, gpus_per_node: int | None = None) -> Device:
    """The catalogue's device `name` (the measured achievable fraction where there is one), with
    `overrides` ({field: value in UNITS}) and `gpus_per_node` applied."""
    if name == "cpu":
        d = cpu()
    elif name in CATALOGUE:
        d = CATALOGUE[name]
        measured = measured_achievable().get(name)
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
        if value <= 0 or (key == "achievable" and value > 1):
            raise UserError(f"--set-device {key}={text}: out of range.\n  fix: "
                            + ("a fraction in (0, 1]" if key == "achievable" else "a positive number"))
        changes[key] = int(value) if key == "gpus_per_node" else value * SCALES.get(key, 1)
        sources[key] = "given on the command line"
    if gpus_per_node is not None:
        changes["gpus_per_node"] = gpus_per_node
        sources["gpus_per_node"] = "given on the command line"
    return replace(d, **changes, sources=sources)


def field_names() -> list[str]:
    return [f.name for f in fields(Device)]
