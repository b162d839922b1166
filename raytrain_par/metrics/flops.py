"""Model FLOPs per step, the peak they are measured against, and model FLOPs utilisation (MFU).

*Model FLOPs* are the floating-point operations one optimizer step needs in principle: every matmul
and convolution of the forward and backward passes, counted once. Not counted: recomputation
(activation checkpointing, or flash attention recomputing its scores in backward), elementwise work
(biases, norms, activations, softmax, the optimizer), and embedding look-ups, which are gathers.
That is the numerator of MFU as PaLM (Chowdhery et al. 2022, appendix B) and torchtitan define it,
so the figure says how well the hardware is used by the model rather than by our implementation of
it: a strategy that recomputes or adds work does not look busier for it.

The count comes from torch's `FlopCounterMode` run once over one sample's forward and backward
through the real model and task, on meta tensors: shapes without storage, so it takes a second for
any model size and the same count holds for every device. On meta tensors scaled-dot-product
attention takes its math path (two bmm forward, four backward) that the counter sees; on real CPU
tensors it runs a fused kernel the counter has no formula for and attention is silently missed,
and on CUDA the counter's flash-attention formula includes the backward's recomputation of the
scores. Causal attention is counted in full (T x T scores, not the lower half), as torchtitan's
12 L d T does. For GPT-2 the count per token is exactly 6 (N_matmul + V d) + 12 L d T, N_matmul =
12 L d^2 the blocks' matmul weights, V d the LM head (tied to the embedding, but a matmul all the
same); tests/test_flops.py checks it, and a hand count for VGG.

The peak: on GPUs this file knows, NVIDIA's datasheet dense figure for the training dtype (what MFU
is usually quoted against) and a measured matmul probe beside it; on CPUs and other devices there
is no datasheet to trust (clocks, cores, AMX or not), so the probe is the peak: a square matmul in
the training dtype at start-up, warmed up, the best of a few repeats.
"""

from __future__ import annotations

import math
import re
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from .. import models

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# -- model FLOPs -----------------------------------------------------------------------------------

def sample_batch(info, rows: int = 1, device: torch.device | str = "meta") -> dict[str, torch.Tensor]:
    """`rows` stored rows as the loader gives them (zeros): token ids [rows, seq_len + 1], or uint8
    images [rows, C, H, W] at their stored size with their labels."""
    if info.kind == "text":
        return {"tokens": torch.zeros(rows, info.seq_len + 1, dtype=torch.int32, device=device)}
    return {"image": torch.zeros(rows, *info.image_shape, dtype=torch.uint8, device=device),
            "label": torch.zeros(rows, dtype=torch.long, device=device)}


def count_flops(model_spec, info, rows: int = 1, checkpointing: str = "none") -> int:
    """FLOPs of the forward and backward of `rows` samples, counted (see the module docstring for what
    counts). `info`: what `models.build_on_meta` takes, a prepared set's `DatasetInfo` or
    `data.shape_of`'s. The step runs as training runs it: `task.prepare` (the image task's
    normalisation and resize, which count nothing), `task.loss`, `backward`. The first convolution's
    input needs no gradient, so its backward computes only the weight gradient: 2x its forward, not 4x.
    With `checkpointing` (train.activation_checkpointing) the modules it names run their forward again
    in backward, and that is counted too."""
    # Under FakeTensorMode, over meta tensors: meta tensors cannot answer `.item()`, and transformers'
    # GPT-2 asks one while building its causal mask (are the positions packed sequences?) unless the
    # tensor is fake, when it takes its tracing path instead: an explicit causal mask rather than
    # SDPA's is_causal, the same matmuls. The tensors are still meta underneath (meta kernels, no
    # storage); fake CPU tensors would take the fused attention kernel the counter misses.
    # (torch._subclasses is private; checked against torch 2.13 and transformers 5.24, as estimate.py uses it.)
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta = torch.device("meta")
    with FakeTensorMode():
        model, task = models.build_on_meta(model_spec, info)
        models.checkpoint_activations(model, checkpointing)
        with FlopCounterMode(display=False) as counter:
            task.loss(model, task.prepare(sample_batch(info, rows, meta), meta)).backward()
    return int(counter.get_total_flops())


def model_flops_per_sample(model_spec, info) -> int:
    """Model FLOPs of one sample's forward and backward."""
    return count_flops(model_spec, info, rows=1)


_PER_SAMPLE: dict[tuple, int] = {}


def _shape_key(model_spec, info) -> tuple:
    """What a model's FLOPs per sample depend on: the model and the data's shape."""
    return (repr(model_spec), info.kind, info.seq_len, info.vocab_size, tuple(info.image_shape or ()),
            info.num_classes)


def recomputed_flops_per_sample(model_spec, info, checkpointing: str) -> int:
    """FLOPs activation checkpointing adds to one sample's step: the checkpointed modules' forward pass,
    run again in backward (`full`: every block's; `selective`: the self-attention's only)."""
    if checkpointing == "none":
        return 0
    key = ("recomputed", checkpointing, *_shape_key(model_spec, info))
    if key not in _PER_SAMPLE:
        # the plain step's count is kept (model_flops_per_step), not counted again
        _PER_SAMPLE[key] = count_flops(model_spec, info, 1, checkpointing) - model_flops_per_step(model_spec, info, 1)
    return _PER_SAMPLE[key]


def model_flops_per_step(model_spec, info, global_batch_size: int) -> int:
    """FLOPs of one optimizer step of `global_batch_size` samples over all workers: per sample times
    the batch (every matmul is linear in the batch; micro-batches and pipeline stages change who
    computes, not how much). Counted once per model spec and data shape in this process."""
    key = _shape_key(model_spec, info)
    if key not in _PER_SAMPLE:
        _PER_SAMPLE[key] = model_flops_per_sample(model_spec, info)
    return _PER_SAMPLE[key] * global_batch_size


# -- the peak --------------------------------------------------------------------------------------

# NVIDIA datasheet figures in TFLOP/s, dense (the datasheets' tensor-core figures marked "with
# sparsity" halved), by device-name pattern, matched against torch.cuda.get_device_name in order
# (more specific first: "H100 NVL" before "H100"; \bA10\b does not match A100 or A10G). "tf32" is
# fp32 training with torch's float32 matmul precision set to "high" or "medium"; at the default
# ("highest") fp32 matmuls run on the plain FP32 units. A dtype a device lacks (bf16 on V100) is
# left out: its peak is the probe's. A10G (AWS) has no NVIDIA datasheet and is left to the probe.
DATASHEET_TFLOPS: list[tuple[str, str, dict[str, float]]] = [
    (r"\bA100\b", "NVIDIA A100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    (r"\bH100 NVL\b", "NVIDIA H100 NVL", {"bf16": 835, "fp16": 835, "tf32": 417, "fp32": 60}),
    (r"\bH100 PCIe\b", "NVIDIA H100 PCIe", {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    (r"\bH100\b", "NVIDIA H100 SXM", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),
    (r"\bH200 NVL\b", "NVIDIA H200 NVL", {"bf16": 835, "fp16": 835, "tf32": 417, "fp32": 60}),
    (r"\bH200\b", "NVIDIA H200", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),
    (r"\bV100-SXM2\b", "NVIDIA V100 SXM2", {"fp16": 125, "fp32": 15.7}),
    (r"\bV100-PCIE\b", "NVIDIA V100 PCIe", {"fp16": 112, "fp32": 14}),
    (r"\bL40S\b", "NVIDIA L40S", {"bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6}),
    (r"\bL4\b", "NVIDIA L4", {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3}),
    (r"\bA10\b", "NVIDIA A10", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
]


def dtype_key(dtype: torch.dtype) -> str:
    """The datasheet column for matmuls in `dtype` on CUDA: fp32 runs as TF32 when torch allows it."""
    name = DTYPE_NAMES[dtype]
    if name == "fp32" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return name


def datasheet_peak(device_name: str, dtype: torch.dtype) -> tuple[float, str] | None:
    """(dense TFLOP/s, source) for a GPU this file knows in `dtype`, else None."""
    key = dtype_key(dtype)
    for pattern, label, figures in DATASHEET_TFLOPS:
        if re.search(pattern, device_name):
            return (float(figures[key]), f"datasheet: {label} {key} dense") if key in figures else None
    return None


PROBE_N = {"cuda": 8192, "cpu": 512}  # other devices: 2048


def probe_size(device: torch.device) -> int:
    return PROBE_N.get(device.type, 2048)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_tflops(device: torch.device | str, dtype: torch.dtype, n: int | None = None, repeats: int = 5,
                 seconds: float = 0.2) -> float:
    """Achieved TFLOP/s of an n x n matmul in `dtype` on `device`, with the threads torch has now.

    Warm-up first (kernel selection, caches, clocks), then `repeats` timed runs of as many matmuls as
    fill about `seconds` / (repeats + 1) each; the best run counts, since anything slower is
    interference, not the hardware. About `seconds` in all."""
    device = torch.device(device)
    n = n or probe_size(device)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    flops = 2 * n**3

    def run(iters: int) -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b)
        _sync(device)
        return time.perf_counter() - start

    run(1)
    one = run(1)
    iters = max(1, round(seconds / (repeats + 1) / max(one, 1e-9)))
    run(iters)  # warm-up at the timed size
    best = min(run(iters) for _ in range(repeats))
    return flops * iters / best / 1e12


def peak(device: torch.device | str, dtype: torch.dtype, repeats: int = 5) -> tuple[float, str, float]:
    """(peak TFLOP/s, where it comes from, the probe's TFLOP/s) for training in `dtype` on `device`:
    the datasheet figure on a GPU this file knows, otherwise the probe itself."""
    device = torch.device(device)
    probed = probe_tflops(device, dtype, repeats=repeats)
    if device.type == "cuda":
        known = datasheet_peak(torch.cuda.get_device_name(device), dtype)
        if known is not None:
            return known[0], known[1], probed
    n = probe_size(device)
    return probed, f"matmul probe: {DTYPE_NAMES[dtype]} {n}x{n}, best of {repeats}", probed


# -- utilisation -----------------------------------------------------------------------------------

def achieved_tflops(flops_per_step: float, step_time_s: float, workers: int) -> float:
    """TFLOP/s of model FLOPs one worker achieves, its share taken as an even split of the step's
    model FLOPs among `workers` (whatever the strategy: data, tensor or pipeline parallel), as
    model FLOPs utilisation defines it."""
    if step_time_s <= 0 or workers <= 0:
        return math.nan
    return flops_per_step / workers / step_time_s / 1e12


def mfu(flops_per_step: float, step_time_s: float, workers: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved model TFLOP/s per worker / the worker's peak TFLOP/s."""
    if peak_tflops <= 0:
        return math.nan
    return achieved_tflops(flops_per_step, step_time_s, workers) / peak_tflops
