"""One GPU, no Ray: how fast and how big GPT-2 medium trains under each data-parallel strategy at
world size 1, against what the chip can do -- timing the product's own training step.

Why: the project's figures come from Ray clusters, where Ray, data loading and communication
between ranks mix into every step. This script takes all of that away -- one process, one GPU,
random tokens made on the device, a GPT-2 written here in nanoGPT's shape -- so what is left is
each strategy's own cost on the chip, and a number (MFU) that says whether the chip is used well
before anything is scaled out. Ray is never imported. Where transformers is missing it falls back to
importing only torch and the standard library, besides benchmarks/common.py and the package's
torch-only modules of the checkout it sits in (found through the repository root, not an install),
so it runs on a bare GPU machine without Ray, transformers, DeepSpeed, numpy or a network. zero-2 /
zero-3 run where DeepSpeed imports; elsewhere their rows say why they did not.

What is timed (`--path`): where the package's engines import (torch, transformers, and DeepSpeed for
zero-2 / zero-3), our own engine's training step (`raytrain_par.strategies`, `Engine.train_step`: the
step `raytrain-par run` trains, without Ray), on the package's GPT-2 (transformers) of the same shape;
elsewhere the stand-alone GPT-2 written here, with torch's DDP / FSDP2 and DeepSpeed, labelled as the
fallback on the page and in every row.

Per strategy (ddp, fsdp, zero-2, zero-3), each in a one-rank process group (nccl; gloo on CPU):
- micro-batch: the largest power of two from 1 (up to --max-batch) with which one step fits in
  CUDA memory, or --batch;
- step time over 10 timed steps after 3 warm-up steps, and tokens/s;
- MFU = model FLOPs per token x tokens/s, against the datasheet's dense peak and against a peak
  measured here (8192^3 matmuls in the compute dtype, the best of 20 runs over 0.5 s). FLOPs per
  token are counted by torch's FlopCounterMode (forward + backward of one sample on the meta
  device) and by torchtitan's formula 6N + 12*L*H*Q*T, with N the parameters without the token
  and position embeddings, plus 6*V*d for the LM head (tied to the token embedding, so not in N,
  but a matmul); no recomputation. Both are printed; the counted one is used when they agree within 5%;
- CUDA memory: the peak, and the model states (allocated after an optimizer step, gradients still
  held, minus what was allocated before the model was built) against 16 bytes per parameter:
  mixed precision with Adam at world size 1 (DDP / FSDP, fp32 parameters under bf16 compute:
  4 + 4 + 8; DeepSpeed bf16 ZeRO: 2 + 2 + 12).

The target on an H200: ddp reaches at least 45% of the measured bf16 matmul peak. The Markdown
says whether it was met, with the numbers, under common.write_page's line (date, commit, machine,
command).

On a GPU machine (one GPU is used; under 5 minutes on an H100 / H200):

    python benchmarks/gpu_check.py                 # docs/gpu-check.md + benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --batch 16 --strategies ddp,fsdp --out-dir /tmp/check

The vocabulary (50257) is padded to a multiple of 64 in the embedding, as nanoGPT does: matmuls
with an odd dimension run on slow kernels. The padding rows are counted in the FLOPs (0.01% of
them); --no-pad-vocab turns it off.

Without a GPU, or with --device cpu, the same script trains a tiny GPT-2 (2 layers, d 64, vocab
512, seq 64) for 2 + 3 steps in seconds (tests/test_gpu_check.py runs it); DeepSpeed rows run on
CPU only with --deepspeed. Results go to benchmarks/results/ there, never to docs/.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import logging
import math
import os
import socket
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

HERE = Path(__file__).resolve().parent  # benchmarks/common.py beside it
REPO = Path.cwd()  # run from the repository's root, as every benchmark
for _path in (str(REPO), str(HERE)):  # the checkout's package (installed or not) and benchmarks/common.py
    if _path not in sys.path:
        sys.path.insert(0, _path)

from common import RESULTS, machine, markdown_table, print_table, provenance, write_json, write_page  # noqa: E402

from raytrain_par.metrics.flops import (  # noqa: E402  (torch only: no Ray, transformers or numpy)
    DTYPE_NAMES, achieved_tflops, datasheet_peak, mfu, probe_size, probe_tflops)

STRATEGIES = ("ddp", "fsdp", "zero-2", "zero-3")
TARGET = 0.45  # ddp's MFU against the measured matmul peak, on an H200
THEORY_BYTES_PER_PARAM = 16  # mixed precision + Adam at world size 1, every strategy (module docstring)
CPU_BATCH = 8


# -- the model: GPT-2 in nanoGPT's shape ---------------------------------------------------------

@dataclass(frozen=True)
class GPTConfig:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab: int      # token ids the data uses
    seq: int
    vocab_rows: int = 0  # rows of the token embedding / LM head (vocab padded); 0: vocab

    @property
    def rows(self) -> int:
        return self.vocab_rows or self.vocab


MODELS = {"medium": GPTConfig("GPT-2 medium", 24, 1024, 16, 50257, 1024),
          "tiny": GPTConfig("tiny GPT-2", 2, 64, 2, 512, 64)}


class Block(nn.Module):
    """Pre-LN transformer block: fused qkv, causal SDPA (flash on GPU), GELU MLP 4x."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.qkv, self.proj = nn.Linear(c.n_embd, 3 * c.n_embd), nn.Linear(c.n_embd, c.n_embd)
        self.fc, self.fc_proj = nn.Linear(c.n_embd, 4 * c.n_embd), nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(self.ln_1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c = c
        self.wte, self.wpe = nn.Embedding(c.rows, c.n_embd), nn.Embedding(c.seq, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.rows, bias=False)
        self.lm_head.weight = self.wte.weight  # tied; a module of its own so ZeRO-3 gathers it
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:  # GPT-2's init: residual projections scaled by 1/sqrt(2 L)
                std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        """Mean cross-entropy of next-token prediction (logits in fp32, as autocast would)."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # the tied weight once


# -- FLOPs per token -----------------------------------------------------------------------------

def formula_flops(c: GPTConfig) -> dict:
    """torchtitan's count, forward + backward, no recomputation: 6 per parameter that multiplies
    each token (the embeddings only index, so N leaves them out), 6*V*d for the tied LM head (a
    matmul, though its weight is the embedding's), and 12*L*H*Q*T for the attention scores and
    their weighted sum over all T positions (H*Q = d; the causal half is not subtracted)."""
    with torch.device("meta"):
        n_total = num_params(GPT(c))
    n = n_total - c.rows * c.n_embd - c.seq * c.n_embd  # blocks (weights, biases, LayerNorms) + ln_f
    parts = {"dense_6N": 6 * n, "lm_head_6Vd": 6 * c.rows * c.n_embd,
             "attention_12LHQT": 12 * c.n_layer * c.n_embd * c.seq}
    return {"params": n_total, "non_embedding_params": n, **parts, "per_token": sum(parts.values())}


def counted_flops(c: GPTConfig) -> float:
    """FLOPs per token that torch's FlopCounterMode counts in a forward + backward of one sample,
    on the meta device (no memory, no compute)."""
    with torch.device("meta"):
        model = GPT(c)
        idx = torch.zeros(1, c.seq, dtype=torch.long)
    counter = FlopCounterMode(display=False)
    with counter:
        model(idx, idx).backward()
    return counter.get_total_flops() / c.seq


def flops_per_token(c: GPTConfig) -> dict:
    f, counted = formula_flops(c), counted_flops(c)
    diff = abs(counted - f["per_token"]) / f["per_token"]
    agree = diff <= 0.05
    return {"formula": f, "counted_per_token": counted, "relative_difference": diff,
            "used": "FlopCounterMode" if agree else "formula",
            "why": (f"FlopCounterMode and the formula agree within 5% ({diff:.2%})" if agree else
                    f"FlopCounterMode differs from the formula by {diff:.1%} (> 5%): the formula is used"),
            "per_token": counted if agree else f["per_token"]}


# -- the measured peak: flops.probe_tflops, given time for a GPU's clocks to ramp up ---------------

PROBE_REPEATS = 20
PROBE_SECONDS = 0.5  # the best of 20 runs over 0.5 s: the later runs are past the clocks' ramp-up


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the strategies: each builds a model + optimizer and returns (step, close) -------------------

def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)


def build_model(c: GPTConfig, device: torch.device) -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(c)


def torch_step(forward: Callable, opt, note):
    """(step, close) for a model torch's own wrapper runs (DDP, FSDP): forward, backward, optimizer step."""
    def step(x, y):
        loss = forward(x, y)
        loss.backward()
        opt.step()
        note()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, None


def build_ddp(c, device, dtype, batch, note):
    model = build_model(c, device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True)  # gradients are views of the buckets: 4 B/param, not 8
    opt = adamw(model.parameters())
    cast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype != torch.float32 else contextlib.nullcontext

    def forward(x, y):
        with cast():
            return ddp(x, y)
    return torch_step(forward, opt, note)


def build_fsdp(c, device, dtype, batch, note):
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch before 2.6 keeps FSDP2 here
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(c, device)
    mesh = init_device_mesh(device.type, (1,))
    mp = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32
          else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return torch_step(model, adamw(model.parameters()), note)  # the policy casts parameters; no autocast


def build_zero(stage: int):
    def build(c, device, dtype, batch, note):
        ds = import_deepspeed(device)[0]
        model = build_model(c, device)
        n = num_params(model)
        # Buckets: 1/32 of the model, at least 1M elements (DeepSpeed's default, 5e8, is 1 GB each).
        bucket = int(min(5e8, max(1 << 20, n // 32)))
        zero = {"stage": stage, "contiguous_gradients": True, "overlap_comm": device.type == "cuda",
                "reduce_bucket_size": bucket}
        if stage == 3:
            zero.update({"stage3_prefetch_bucket_size": bucket, "stage3_max_live_parameters": 2 * bucket,
                         "stage3_max_reuse_distance": bucket,
                         # parameters below this many elements stay whole (biases, norms)
                         "stage3_param_persistence_threshold": min(100_000, n // 1000)})
        else:
            zero["allgather_bucket_size"] = bucket
        config = {"train_batch_size": batch, "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0: the other strategies do not clip
                  "bf16": {"enabled": dtype == torch.bfloat16}, "zero_optimization": zero,
                  "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
                  "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
        ds.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
        engine, _, _, _ = ds.initialize(model=model, optimizer=adamw(model.parameters()), config=config,
                                        dist_init_required=False)

        def step(x, y):
            loss = engine(x, y)  # DeepSpeed made the parameters bf16
            engine.backward(loss)
            engine.step()  # steps and zeroes the gradients
            note()
            return loss.detach()
        return step, engine.destroy
    return build


BUILDERS = {"ddp": build_ddp, "fsdp": build_fsdp, "zero-2": build_zero(2), "zero-3": build_zero(3)}


# -- our own engine: the training step `raytrain-par run` takes, here without Ray ----------------

ENGINE_PATH = "engine"  # raytrain_par.strategies' Engine.train_step on the package's GPT-2
STANDALONE_PATH = "stand-alone"  # the GPT-2 above with torch's / DeepSpeed's own wrappers (fallback)


def engine_unavailable() -> Optional[str]:
    """None where the package's engines and models import here, else why not (a bare GPU machine
    without transformers runs the stand-alone model instead)."""
    try:
        import transformers  # noqa: F401

        from raytrain_par import models, strategies  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import means the fallback
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def engine_experiment(name: str, c: GPTConfig, device: torch.device, dtype: torch.dtype, batch: int) -> dict:
    """The experiment whose step is timed: the package's GPT-2 with this model's shape (vocabulary at
    the embedding's rows), no dropout, AdamW as above, no clipping, a constant learning rate."""
    return {"name": "gpu-check",
            "model": {"name": "gpt2-medium", "n_layer": c.n_layer, "n_embd": c.n_embd, "n_head": c.n_head},
            "data": {"name": "kjv", "seq_len": c.seq, "vocab_size": c.rows},
            "strategy": {"name": name}, "scaling": {"num_workers": 1, "use_gpu": device.type == "cuda"},
            "train": {"global_batch_size": batch, "max_steps": 1, "optimizer": "adamw", "lr": 1e-4,
                      "betas": [0.9, 0.95], "weight_decay": 0.0, "grad_clip": 0.0, "warmup_steps": 0,
                      "lr_schedule": "constant", "precision": "bf16" if dtype == torch.bfloat16 else "fp32"}}


def build_engine(name: str):
    def build(c, device, dtype, batch, note):
        from raytrain_par import config, models, strategies
        from raytrain_par.data.shards import DatasetInfo
        from raytrain_par.strategies import DistContext

        spec = config.parse(engine_experiment(name, c, device, dtype, batch))
        info = DatasetInfo(name="gpu-check", kind="text", train_path="", val_path="", num_train=0, num_val=0,
                           seq_len=c.seq, vocab_size=c.rows)
        model, task = models.build(spec.model, info, seed=0)
        engine = strategies.build_engine(spec.strategy, model, task, spec.train, DistContext.current(device), 1)
        del model
        # The engine measures model states right before and right after its optimizer step, gradients
        # still held: where this script takes its own figure.
        engine.note_memory = note

        def step(x, y):
            return engine.train_step({"tokens": torch.cat([x, y[:, -1:]], dim=1)})
        return step, getattr(engine.module, "destroy", None)  # DeepSpeed's engine
    return build
_deepspeed: dict = {}


def import_deepspeed(device: torch.device):
    """(deepspeed, None) or (None, why not). Imported once, lazily: it reads DS_ACCELERATOR at import."""
    if "result" not in _deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", device.type)
        try:
            import deepspeed
        except Exception as e:  # ImportError, or a broken install failing at import
            _deepspeed["result"] = (None, f"deepspeed not importable ({type(e).__name__}: {str(e)[:120]})")
        else:
            logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
            # DeepSpeed calls torch.distributed APIs that torch has deprecated: one warning per call.
            warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
            if device.type == "cpu":
                # Its CPU accelerator JIT-compiles a shared-memory all-reduce (37-140 s) on first use;
                # training never uses it (gradients go through the torch process group).
                import deepspeed.ops
                from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
                deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
            _deepspeed["result"] = (deepspeed, None)
    return _deepspeed["result"]


def deepspeed_skip_reason(device: torch.device, allowed_on_cpu: bool) -> Optional[str]:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not importable (not installed)"
    if device.type == "cpu" and not allowed_on_cpu:
        return "deepspeed runs in CPU mode only with --deepspeed (kept out of the seconds-long CPU check)"
    return import_deepspeed(device)[1]


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """A process group of this process alone, on a free localhost port (torchrun's env vars)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- measuring one strategy ----------------------------------------------------------------------

@dataclass
class Setup:
    cfg: GPTConfig
    device: torch.device
    dtype: torch.dtype
    warmup: int
    steps: int
    max_batch: int
    batch: Optional[int]  # every strategy's micro-batch; None: search for the largest that fits
    batch_how: str        # where a fixed batch comes from
    deadline: float       # time.monotonic() after which no strategy starts
    deepspeed_on_cpu: bool
    path: str = STANDALONE_PATH  # what is timed: ENGINE_PATH or STANDALONE_PATH


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_batch(c: GPTConfig, batch: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(1)
    return tuple(torch.randint(c.vocab, (batch, c.seq), device=device, generator=g) for _ in range(2))


def close_quietly(close: Optional[Callable]) -> None:
    """Tear a DeepSpeed engine down; after an out-of-memory error it may be half-way through a step."""
    if close:
        try:
            close()
        except Exception as e:
            print(f"warning: closing the engine: {type(e).__name__}: {e}", file=sys.stderr)


def largest_batch(build: Callable, s: Setup) -> tuple[int, str]:
    """The largest power of two (from 1, up to s.max_batch) with which one step fits; 0 if none."""
    step, close = build(s.cfg, s.device, s.dtype, 1, lambda: None)
    best, oom_at, b = 0, None, 1
    while b <= s.max_batch and time.monotonic() < s.deadline:
        try:
            step(*random_batch(s.cfg, b, s.device))
            sync(s.device)
            best = b
        except RuntimeError as e:
            if not is_oom(e):
                raise
            oom_at = b
        if oom_at:
            break
        b *= 2
    close_quietly(close)
    del step, close
    free(s.device)
    how = f"{oom_at} ran out of memory" if oom_at else ("--max-batch reached" if b > s.max_batch else "time budget spent")
    return best, f"largest power of two that fits ({how})" if best else how


def measure(build: Callable, s: Setup, batch: int) -> dict:
    """Warm up, then time s.steps steps; CUDA memory statistics on CUDA."""
    cuda = s.device.type == "cuda"
    x, y = random_batch(s.cfg, batch, s.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(s.device)
    before = torch.cuda.memory_allocated(s.device) if cuda else 0
    after_step = {}

    def note():
        if cuda:
            after_step["bytes"] = torch.cuda.memory_allocated(s.device)
    step, close = build(s.cfg, s.device, s.dtype, batch, note)
    try:
        for _ in range(s.warmup):
            loss = step(x, y)
        sync(s.device)
        retries = alloc_retries(s.device)
        t0 = time.perf_counter()
        for _ in range(s.steps):
            loss = step(x, y)
        sync(s.device)
        elapsed = time.perf_counter() - t0
        retries = None if retries is None else alloc_retries(s.device) - retries
    finally:
        close_quietly(close)
    return {"step_time_s": elapsed / s.steps, "loss": float(loss), "allocated_before_model_bytes": before,
            "alloc_retries": retries,
            "peak_mem_bytes": torch.cuda.max_memory_allocated(s.device) if cuda else None,
            "model_state_bytes": after_step["bytes"] - before if cuda else None}


def alloc_retries(device: torch.device) -> Optional[int]:
    """How often CUDA's caching allocator has had to free its cache and try again (None off CUDA). A batch at
    the edge of memory can fit only that way: every retry synchronizes, and the step time goes up unseen."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else None


def empty_row(strategy: str, status: str, flops: dict, device: torch.device) -> dict:
    """Every row has every column; what was not measured is None."""
    params = flops["formula"]["params"]
    return {"strategy": strategy, "status": status, "path": None, "batch": None, "batch_how": None, "tokens_per_step": None,
            "step_time_s": None, "tokens_per_s": None, "achieved_tflops": None, "mfu_vs_datasheet": None,
            "mfu_vs_measured": None, "loss": None, "peak_mem_bytes": None, "model_state_bytes": None,
            "allocated_before_model_bytes": None, "model_state_bytes_per_param": None, "alloc_retries": None,
            "theory_bytes_per_param": THEORY_BYTES_PER_PARAM, "theory_model_state_bytes": THEORY_BYTES_PER_PARAM * params,
            "memory_note": None if device.type == "cuda" else
            "null on CPU: CUDA memory statistics only (benchmarks/memory.py measures host memory)"}


def run_strategy(name: str, s: Setup, flops: dict, peaks: dict) -> dict:
    row = empty_row(name, "ok", flops, s.device)
    row["path"] = s.path
    if name.startswith("zero") and (why := deepspeed_skip_reason(s.device, s.deepspeed_on_cpu)):
        row["status"] = f"skipped: {why}"
        return row
    build = build_engine(name) if s.path == ENGINE_PATH else BUILDERS[name]
    try:
        if s.batch:
            batch, how = s.batch, s.batch_how
        else:
            batch, how = largest_batch(build, s)
            if not batch:
                row["status"] = f"skipped: no micro-batch fits ({how}); fix: a GPU with more memory, or --model tiny"
                return row
        while True:
            oom = False
            try:
                m = measure(build, s, batch)
            except RuntimeError as e:
                if not is_oom(e):
                    raise
                oom = True
            free(s.device)
            # A searched batch that only fitted by the allocator freeing its cache and retrying is timed at
            # half the batch instead; one the user chose is kept, and the row says so.
            retried = not oom and m["alloc_retries"] and not s.batch and batch > 1
            if not oom and not retried:
                break
            if s.batch or batch == 1:
                row["status"] = (f"failed: batch {batch} ({how}) runs out of CUDA memory; fix: a smaller --batch, "
                                 "or leave --batch out to search for the largest that fits")
                return row
            why = (f"the allocator freed its cache and retried {m['alloc_retries']} times in the timed run at {batch}"
                   if retried else f"{batch} ran out of memory in the timed run")
            batch, how = batch // 2, f"{how}; halved: {why}"
    except Exception as e:
        traceback.print_exc()
        free(s.device)
        row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return row
    tokens, step_s = batch * s.cfg.seq, m["step_time_s"]
    step_flops = flops["per_token"] * tokens  # one rank: the whole step is this chip's share
    row.update(batch=batch, batch_how=how, tokens_per_step=tokens, step_time_s=step_s, tokens_per_s=tokens / step_s,
               achieved_tflops=achieved_tflops(step_flops, step_s, 1), loss=m["loss"],
               mfu_vs_measured=mfu(step_flops, step_s, 1, peaks["measured_tflops"]),
               mfu_vs_datasheet=(mfu(step_flops, step_s, 1, peaks["datasheet_tflops"])
                                 if peaks["datasheet_tflops"] else None),
               peak_mem_bytes=m["peak_mem_bytes"], model_state_bytes=m["model_state_bytes"],
               allocated_before_model_bytes=m["allocated_before_model_bytes"], alloc_retries=m["alloc_retries"])
    if m["alloc_retries"]:
        row["status"] = (f"ok, but the allocator freed its cache and retried {m['alloc_retries']} times in the timed "
                         f"steps (the step time includes them); fix: a smaller --batch")
    if m["model_state_bytes"] is not None:
        row["model_state_bytes_per_param"] = m["model_state_bytes"] / flops["formula"]["params"]
    if not math.isfinite(m["loss"]):
        row["status"] = f"failed: the loss is {m['loss']}"
    return row


# -- how results are written (common.write_json / write_page add date, commit, machine, command) --

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    n = torch.get_num_threads()
    threads = f"{n} torch thread{'s' if n != 1 else ''}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()} ({threads})"
    return f"CPU {machine()['processor']} ({threads})"


def fmt(v, spec: str = ".3g", pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:.1%}" if pct else format(v, spec)


def gib(v) -> str:
    return "-" if v is None else f"{v / 2**30:.2f}"


HEAD = ["strategy", "path", "status", "batch", "step s", "tokens/s", "TFLOP/s", "MFU datasheet", "MFU measured",
        "peak GiB", "state GiB", "state B/param", "theory B/param"]


def table_rows(rows: list[dict]) -> list[list]:
    return [[r["strategy"], r["path"] or "-", r["status"], fmt(r["batch"], "d"), fmt(r["step_time_s"], ".4f"),
             fmt(r["tokens_per_s"], ",.0f"), fmt(r["achieved_tflops"], ".4g"), fmt(r["mfu_vs_datasheet"], pct=True),
             fmt(r["mfu_vs_measured"], pct=True), gib(r["peak_mem_bytes"]), gib(r["model_state_bytes"]),
             fmt(r["model_state_bytes_per_param"], ".2f"), r["theory_bytes_per_param"]] for r in rows]


def target_line(rows: list[dict], peaks: dict) -> tuple[Optional[bool], str]:
    ddp = next((r for r in rows if r["strategy"] == "ddp"), None)
    what = f"ddp MFU >= {TARGET:.0%} of the measured {peaks['dtype']} matmul peak"
    if ddp is None or ddp["mfu_vs_measured"] is None:
        return None, f"Target ({what}): NOT met: ddp did not run ({ddp['status'] if ddp else 'not among --strategies'})."
    met = ddp["mfu_vs_measured"] >= TARGET
    return met, (f"Target ({what}): {'met' if met else 'NOT met'}: ddp {ddp['mfu_vs_measured']:.1%} "
                 f"({ddp['achieved_tflops']:.4g} of {peaks['measured_tflops']:.4g} TFLOP/s).")


def page_body(run: dict, flops: dict, peaks: dict, rows: list[dict], target: str) -> str:
    """The page below write_page's title and provenance line."""
    c, f = run["model"], flops["formula"]
    pad = f", embedding padded to {c['vocab_rows']} rows" if c["vocab_rows"] else ""
    ds = (f"{peaks['datasheet_tflops']:g} TFLOP/s dense {peaks['dtype']}" if peaks["datasheet_tflops"]
          else f"n/a ({run['device']} is not in the table)")
    timed = ("our own engine's training step (`raytrain_par.strategies`, `Engine.train_step`, as `raytrain-par run` "
             "trains it, without Ray) on the package's GPT-2 (transformers) of this shape"
             if run["path"] == ENGINE_PATH else
             f"the stand-alone GPT-2 of benchmarks/gpu_check.py with torch's DDP / FSDP2 and DeepSpeed, a fallback "
             f"({run['path_reason']})")
    lines = [
        f"- timed: {timed}",
        f"- device: {run['device']}" + (f" (environment: {run['env']})" if run["env"] else ""),
        f"- model: {c['n_layer']} layers, d {c['n_embd']}, {c['n_head']} heads, vocab {c['vocab']}{pad}, "
        f"seq {c['seq']}; {f['params']:,} parameters; compute in {peaks['dtype']}; random init, random tokens",
        f"- FLOPs per token (forward + backward): {flops['counted_per_token']:.4g} counted by FlopCounterMode; "
        f"{f['per_token']:.4g} by 6N + 6Vd + 12LHQT (N = {f['non_embedding_params']:,} parameters without "
        f"the embeddings); {flops['why']}; MFU uses the {flops['used']} count",
        f"- peak: datasheet {ds}; measured {peaks['measured_tflops']:.4g} TFLOP/s "
        f"({peaks['dtype']} {peaks['probe_n']}^3 matmul, best of {peaks['probe_repeats']})",
        f"- memory theory at world size 1 with Adam: {THEORY_BYTES_PER_PARAM} B/param ("
        + ("mixed precision: DDP / FSDP 4 + 4 + 8, DeepSpeed ZeRO 2 + 2 + 12)" if peaks["dtype"] == "bf16"
           else "fp32: 4 + 4 + 8)"),
        "",
        f"**{target}**" + ("" if run["device_kind"] == "cuda" else
                           " (The target is set for GPT-2 medium on an H200: on a CPU the line only shows the check runs.)"),
        "",
        markdown_table(HEAD, [[str(v).replace("|", "\\|") for v in r] for r in table_rows(rows)]),
    ]
    memory = ("peak: torch.cuda.max_memory_allocated over warm-up and timed steps; state: allocated right after "
              "the optimizer step (DDP and FSDP still hold their gradients, DeepSpeed's step has freed its own) "
              "minus what was allocated before the model was built" if run["device_kind"] == "cuda" else
              "CUDA memory statistics only: not measured on CPU")
    batches = "; ".join(f"{r['strategy']} {r['batch_how']}" for r in rows if r["batch_how"])
    lines += ["", f"- batch: {batches or 'no strategy ran'}", f"- memory: {memory}",
              f"- FLOPs per token by the formula: 6N {f['dense_6N']:.4g} + 6Vd {f['lm_head_6Vd']:.4g} + "
              f"12LHQT {f['attention_12LHQT']:.4g} (no recomputation; full T x T attention, as torchtitan counts)", ""]
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto (default): cuda when available, else cpu (the tiny model)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated subset of {','.join(STRATEGIES)}")
    p.add_argument("--model", choices=tuple(MODELS), help="medium (default on cuda) or tiny (default on cpu)")
    p.add_argument("--batch", type=int, help="micro-batch for every strategy; skips the search for the largest that fits")
    p.add_argument("--max-batch", type=int, default=256, help="largest micro-batch the search tries (default 256)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default 3 on cuda, 2 on cpu)")
    p.add_argument("--steps", type=int, help="timed steps (default 10 on cuda, 3 on cpu)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="compute dtype (default bf16; on cpu fp32 where "
                   "bf16 matmuls run at under 1/4 of fp32's rate)")
    p.add_argument("--no-pad-vocab", action="store_true", help="keep the embedding at the vocabulary's 50257 rows "
                   "(default: padded to a multiple of 64, as nanoGPT does)")
    p.add_argument("--probe-size", type=int,
                   help="n of the n^3 matmul that measures the peak (default 8192 on cuda, 512 on cpu)")
    p.add_argument("--path", choices=("auto", ENGINE_PATH, STANDALONE_PATH), default="auto",
                   help="what is timed: auto (default): our engine where the package imports, else the stand-alone "
                   "model; engine: fail where it does not import; stand-alone: the script's own GPT-2")
    p.add_argument("--deepspeed", action="store_true", help="run zero-2 / zero-3 in CPU mode too (skipped there by default)")
    p.add_argument("--time-budget", type=float, default=270.0, help="seconds after which no further strategy starts; "
                   "one is also skipped when the slowest so far would not fit (default 270: the run stays under 5 min)")
    p.add_argument("--out-dir", help="directory for gpu_check.json and gpu-check.md (default: JSON in "
                   "benchmarks/results/, Markdown in docs/ on cuda, benchmarks/results/ on cpu)")
    a = p.parse_args(argv)

    def bad(flag, value, problem, fix):
        p.error(f"{flag} = {value}: {problem}; fix: {fix}")
    names = [n.strip() for n in a.strategies.split(",") if n.strip()]
    for n in names:
        if n not in STRATEGIES:
            bad("--strategies", a.strategies, f"unknown strategy {n!r}", f"choose from {','.join(STRATEGIES)}")
    if not names:
        bad("--strategies", repr(a.strategies), "no strategy named", f"choose from {','.join(STRATEGIES)}")
    a.strategies = names
    if a.device == "cuda" and not torch.cuda.is_available():
        bad("--device", "cuda", f"torch {torch.__version__} sees no CUDA device",
            "run on a GPU machine, or use --device cpu")
    positive = (("--batch", a.batch), ("--max-batch", a.max_batch), ("--steps", a.steps), ("--probe-size", a.probe_size))
    for flag, v in positive:
        if v is not None and v < 1:
            bad(flag, v, "must be >= 1", f"pass a positive {flag}")
    if a.warmup is not None and a.warmup < 0:
        bad("--warmup", a.warmup, "must be >= 0", "pass 0 or more")
    if a.time_budget <= 0:
        bad("--time-budget", a.time_budget, "must be > 0", "pass seconds, e.g. 270")
    return a


def _record_achievable(name: str, rows: list[dict], run: dict, peaks: dict) -> str | None:
    """The best MFU against the datasheet's peak, as the fraction of it `raytrain-par estimate --device`
    takes as achievable on this GPU (raytrain_par/devices.py reads raytrain_par/achievable.json)."""
    from raytrain_par.devices import ACHIEVABLE_FILE, record_achievable

    measured = [r for r in rows if r.get("mfu_vs_datasheet")]
    if not measured:
        return None
    best = max(measured, key=lambda r: r["mfu_vs_datasheet"])
    source = (f"benchmarks/gpu_check.py on {name}, {run['date']}, commit {run['commit']}: {best['strategy']} "
              f"{run['model']['name']} at {best['mfu_vs_datasheet']:.1%} of the datasheet's {peaks['dtype']} peak")
    entry = record_achievable(name, best["mfu_vs_datasheet"], source)
    return None if entry is None else f"wrote {ACHIEVABLE_FILE}: {entry} achievable {best['mfu_vs_datasheet']:.1%}"


def main(argv=None) -> int:
    start = time.monotonic()
    a = parse_args(argv)
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if cuda:
        # Before CUDA's allocator starts (it reads this once): segments that grow in place, so that the
        # batch search's freed blocks do not fragment the memory the timed runs build in (torchtitan's
        # setting too). A value already set is kept, and the page records it.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = MODELS[a.model or ("medium" if cuda else "tiny")]
    if not a.no_pad_vocab and cfg.vocab % 64:
        cfg = replace(cfg, vocab_rows=-(-cfg.vocab // 64) * 64)

    probe_n = a.probe_size or probe_size(device)

    def probe(dtype):
        return probe_tflops(device, dtype, probe_n, repeats=PROBE_REPEATS, seconds=PROBE_SECONDS)
    rates = {}
    if a.dtype:
        dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    elif cuda:
        dtype = torch.bfloat16
    else:  # CPUs without native bf16 run it an order of magnitude slower than fp32
        rates = {d: probe(d) for d in (torch.bfloat16, torch.float32)}
        dtype = torch.bfloat16 if rates[torch.bfloat16] >= rates[torch.float32] / 4 else torch.float32
    dname = DTYPE_NAMES[dtype]
    measured = rates.get(dtype) or probe(dtype)
    name = device_name(device)
    sheet = datasheet_peak(name, dtype) if cuda else None  # (TFLOP/s, source) or None
    peaks = {"dtype": dname, "datasheet_tflops": sheet[0] if sheet else None,
             "measured_tflops": measured, "probe_n": probe_n, "probe_repeats": PROBE_REPEATS,
             "cpu_rates_tflops": {str(d).removeprefix("torch."): r for d, r in rates.items()} or None}
    flops = flops_per_token(cfg)
    print(f"{name}: {cfg.name}, {flops['formula']['params']:,} parameters, compute {dname}; FLOPs/token "
          f"{flops['counted_per_token']:.4g} counted, {flops['formula']['per_token']:.4g} by formula "
          f"({flops['used']} used); peak {measured:.4g} TFLOP/s measured, "
          f"{peaks['datasheet_tflops'] or 'n/a'} datasheet", flush=True)

    why = engine_unavailable() if a.path != STANDALONE_PATH else None
    if a.path == ENGINE_PATH and why:
        print(f"error: --path engine: the package's engines do not import here ({why}); fix: install the "
              "package (pip install -e .), or use --path stand-alone", file=sys.stderr)
        return 2
    reason = ("chosen with --path stand-alone" if a.path == STANDALONE_PATH else
              f"the package's engines do not import here: {why}" if why else None)
    path = STANDALONE_PATH if reason else ENGINE_PATH
    print(f"timing {'our engine (raytrain_par.strategies)' if path == ENGINE_PATH else f'the stand-alone model ({reason})'}",
          flush=True)
    s = Setup(cfg, device, dtype, a.warmup if a.warmup is not None else (3 if cuda else 2),
              a.steps or (10 if cuda else 3), a.max_batch, a.batch or (None if cuda else CPU_BATCH),
              "--batch" if a.batch else "fixed in CPU mode", start + a.time_budget, a.deepspeed, path)
    rows, slowest = [], 0.0
    with one_rank_group(device):
        for strategy in a.strategies:
            now = time.monotonic()
            if now + slowest > s.deadline:
                rows.append(empty_row(strategy, f"skipped: time budget ({a.time_budget:.0f} s): {now - start:.0f} s "
                                      f"spent, the slowest strategy took {slowest:.0f} s; rerun with --strategies "
                                      f"{strategy} or a larger --time-budget", flops, device))
                continue
            rows.append(run_strategy(strategy, s, flops, peaks))
            slowest = max(slowest, time.monotonic() - now)
            print(f"{strategy}: {rows[-1]['status']} ({time.monotonic() - now:.1f} s)", flush=True)

    met, target = target_line(rows, peaks)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR",
                                                       "PYTORCH_CUDA_ALLOC_CONF")
                   if k in os.environ)
    p = provenance()
    run = {"date": p["date"], "commit": p["commit"], "device": name, "device_kind": device.type,
           "command": p["command"], "env": env, "model": asdict(cfg), "dtype": dname, "warmup": s.warmup,
           "path": path, "path_reason": reason,
           "steps": s.steps, "wall_s": time.monotonic() - start}
    out_dir = Path(a.out_dir) if a.out_dir else None
    json_path = write_json("gpu_check", {"run": run, "flops": flops, "peak": peaks,
                                         "target": {"threshold": TARGET, "met": met, "line": target}, "rows": rows},
                           str(out_dir / "gpu_check.json") if out_dir else None)
    md_path = write_page("gpu-check", f"GPU check: {cfg.name} at world size 1, without Ray",
                         page_body(run, flops, peaks, rows, target),
                         str((out_dir or (REPO / "docs" if cuda else RESULTS)) / "gpu-check.md"))

    achievable = _record_achievable(name, rows, run, peaks) if cuda and not out_dir else None

    print()
    print_table(HEAD, table_rows(rows))
    print(f"\n{target}\nwrote {json_path} and {md_path} in {run['wall_s']:.0f} s")
    if achievable:
        print(achievable)
    return 1 if any(r["status"].startswith("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
