"""The releases of torch, DeepSpeed and transformers whose private APIs this package calls, as they
were checked.

A few things have no public API in either library (listed in CHECKED, each where it is used). They
were checked against these releases; another release may have moved them. pyproject.toml pins
DeepSpeed to its checked minor release; torch is left a range (GPU images bring the CUDA build they
were made with, and replacing it costs gigabytes), and so is transformers (users bring the release
their models need), so a release outside the checked one is named before a run starts, with what
may break.
"""

from __future__ import annotations

from importlib import metadata

# package -> (checked release, as a version prefix; what of it is private, and where it is used)
CHECKED: dict[str, tuple[str, list[str]]] = {
    "torch": ("2.13", [
        "torch.distributed.pipelining's schedule-order functions (strategies/pipeline.py, estimate)",
        "FSDP2's set_custom_reduce_scatter (strategies/fsdp.py, the gradient noise scale)",
        "the autograd engine's queue_callback (strategies/zero.py, ZeRO-1's memory count)",
        "torch._subclasses' FakeTensorMode (estimate, metrics/flops.py)",
    ]),
    "deepspeed": ("0.19", [
        "ZeRO-1/2's optimizer-state linking and ZeRO-3's grad_position (strategies/zero.py: a checkpoint "
        "resumed on another worker count)",
        "deepspeed.ops.__compatible_ops__ (strategies/zero.py: its CPU communication op left unbuilt)",
    ]),
    "transformers": ("5.25", [
        "config._attn_implementation and each model file's eager_attention_forward (strategies/tensor_split.py: "
        "attention dropout from the tensor-parallel stream)",
    ]),
}


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def unchecked(versions: dict[str, str | None] | None = None) -> list[str]:
    """A warning for each package whose installed release is not the one its private APIs were checked
    against (`versions`: package -> installed version, default what is installed)."""
    out = []
    for package, (release, uses) in CHECKED.items():
        have = versions.get(package) if versions is not None else installed(package)
        if have is None or _release(have) == release:
            continue
        out.append(f"{package} {have} is installed; these private parts of it were checked against {package} "
                   f"{release}.x only: {'; '.join(uses)}. If one of them fails, install {package}=={release}.*")
    return out


def _release(version: str) -> str:
    """'2.13.0+cu128' -> '2.13'."""
    return ".".join(version.split("+")[0].split(".")[:2])
