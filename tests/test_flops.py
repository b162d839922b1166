"""Model FLOPs counted on meta tensors against formulas and hand counts; peaks; MFU arithmetic."""

import math

import pytest
import torch

from raytrain_par import config, data
from raytrain_par.metrics import flops


def text(seq_len, vocab_size):
    return data.shape_of(config.DataSpec(name="kjv", seq_len=seq_len, vocab_size=vocab_size))


@pytest.mark.parametrize("spec, L, d, T, V", [
    (config.ModelSpec.of("gpt2-tiny"), 2, 128, 32, 256),
    (config.ModelSpec.of("gpt2-mini", n_layer=3), 3, 256, 64, 512),
])
def test_gpt2_count_is_the_transformer_formula_exactly(spec, L, d, T, V):
    n_matmul = 12 * L * d * d  # q, k, v, attention out (4 d^2) and the MLP (8 d^2) per block
    # 6 per weight per token (forward 2, backward 4) including the LM head (V d, the tied embedding),
    # and attention's scores and weighted sum: 4 T d per layer forward, 8 backward, counted full (not causal).
    per_token = 6 * (n_matmul + V * d) + 12 * L * d * T
    # Exact: the counter counts only matmuls (addmm's bias add, layer norms, GELU, softmax and the
    # embedding look-ups count nothing), and on meta tensors attention runs as plain bmm, without
    # flash attention's recomputation of the scores in backward.
    assert flops.model_flops_per_sample(spec, text(T, V)) == T * per_token


def test_vgg_count_is_the_hand_count():
    # vgg11 at width 1/8 on 8x8 digits resized to 16x16 (the task's interpolate runs on meta too).
    spec = config.ModelSpec.of("vgg11", width=0.125, image_size=16)
    info = data.shape_of(config.DataSpec(name="digits"))
    # (C_in, C_out, H = W) of each 3x3 convolution (padding 1): pools halve 16 -> 8 -> 4 -> 2 -> 1, the fifth is skipped.
    convs = [(1, 8, 16), (8, 16, 8), (16, 32, 4), (32, 32, 4), (32, 64, 2), (64, 64, 2), (64, 64, 1), (64, 64, 1)]
    linears = [(64, 512), (512, 512), (512, 10)]  # pooled to 1x1: 64 features
    forward = sum(2 * ci * co * 9 * h * h for ci, co, h in convs) + sum(2 * i * o for i, o in linears)
    # backward: input and weight gradients (2x forward), except the first convolution's input (the image)
    first_input_grad = 2 * 1 * 8 * 9 * 16 * 16
    assert forward == 1_816_576
    assert flops.model_flops_per_sample(spec, info) == 3 * forward - first_input_grad


@pytest.mark.parametrize("spec, info", [
    (config.ModelSpec.of("gpt2-tiny"), text(16, 128)),
    (config.ModelSpec.of("vgg11", width=0.125), data.shape_of(config.DataSpec(name="digits"))),
])
def test_flops_are_linear_in_the_batch(spec, info, monkeypatch):
    one = flops.count_flops(spec, info, rows=1)
    assert flops.count_flops(spec, info, rows=3) == 3 * one  # counted on a real batch of 3
    counted = []
    monkeypatch.setattr(flops, "_PER_SAMPLE", {})
    monkeypatch.setattr(flops, "model_flops_per_sample", lambda *a: counted.append(a) or one)
    assert flops.model_flops_per_step(spec, info, 32) == 32 * one
    assert flops.model_flops_per_step(spec, info, 8) == 8 * one
    assert len(counted) == 1  # once per model and shape


def test_probe_and_cpu_peak():
    probed = flops.probe_tflops("cpu", torch.float32, n=64, repeats=2, seconds=0.02)
    assert probed > 0 and math.isfinite(probed)
    value, source, probe = flops.peak("cpu", torch.float32, repeats=3)
    assert value == probe > 0 and math.isfinite(value)
    assert source == "matmul probe: fp32 512x512, best of 3"


def test_datasheet_lookup():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert flops.datasheet_peak("NVIDIA H100 80GB HBM3", bf16) == (989.0, "datasheet: NVIDIA H100 SXM bf16 dense")
    assert flops.datasheet_peak("NVIDIA H100 PCIe", bf16)[0] == 756.0
    assert flops.datasheet_peak("NVIDIA H200", bf16) == (989.0, "datasheet: NVIDIA H200 bf16 dense")
    assert flops.datasheet_peak("NVIDIA A100-SXM4-80GB", bf16)[0] == 312.0
    assert flops.datasheet_peak("NVIDIA A100 80GB PCIe", torch.float16)[0] == 312.0
    assert flops.datasheet_peak("NVIDIA A100-SXM4-40GB", fp32)[0] == 19.5
    assert flops.datasheet_peak("Tesla V100-SXM2-16GB", torch.float16)[0] == 125.0
    assert flops.datasheet_peak("Tesla V100-SXM2-16GB", bf16) is None  # no bf16 units: the probe decides
    assert flops.datasheet_peak("NVIDIA A10G", bf16) is None  # not the A10, not an A100
    assert flops.datasheet_peak("Some Future Accelerator", bf16) is None
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # fp32 matmuls on TF32 tensor cores
        assert flops.datasheet_peak("NVIDIA A100-SXM4-80GB", fp32) == (156.0, "datasheet: NVIDIA A100 tf32 dense")
    finally:
        torch.set_float32_matmul_precision(before)


def test_mfu_by_hand():
    # 6e12 FLOPs a step over 4 workers in 0.5 s: 1.5e12 each, 3 TFLOP/s; against a 12 TFLOP/s peak, 25%.
    assert flops.achieved_tflops(6e12, 0.5, 4) == pytest.approx(3.0)
    assert flops.mfu(6e12, 0.5, 4, peak_tflops=12.0) == pytest.approx(0.25)
    assert math.isnan(flops.mfu(6e12, 0.0, 4, 12.0))
