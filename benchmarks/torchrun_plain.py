"""Plain training of a GPT-2 on prepared shards under `torchrun`, written as a user of each library
would write it: the baseline that benchmarks/overhead.py compares raytrain-par's engines under Ray
against. Deliberately torch, transformers, DeepSpeed and pyarrow only -- no raytrain-par code in
the timed loop.

    --strategy ddp     torch DistributedDataParallel (bf16: torch.autocast)
    --strategy fsdp    FSDP2 `fully_shard` on every GPT-2 block, then the root (bf16: MixedPrecisionPolicy)
    --strategy zero-N  deepspeed.initialize with the DeepSpeed config given in --deepspeed-config

    torchrun --nproc_per_node 2 benchmarks/torchrun_plain.py --strategy ddp --data DIR --seq-len 128 \
        --vocab 8192 --n-layer 2 --n-embd 128 --n-head 4 --batch 32 --warmup 5 --steps 30 --block 5 --out result.json
"""

import argparse
import contextlib
import glob
import json
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp", "zero-1", "zero-2", "zero-3"])
    for name, typ in [("data", str), ("seq-len", int), ("vocab", int), ("n-layer", int), ("n-embd", int),
                      ("n-head", int), ("batch", int), ("warmup", int), ("steps", int), ("out", str)]:
        p.add_argument(f"--{name}", type=typ, required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--no-reshard-after-forward", action="store_true")
    p.add_argument("--deepspeed-config", help="JSON file: the DeepSpeed config (zero-N)")
    p.add_argument("--init", help="safetensors file: the weights to start from (default: transformers' own "
                   "initialisation, seeded with 0)")
    p.add_argument("--block", type=int, default=None, help="time the steps in blocks of this many (default: --steps)")
    return p


def read_tokens(a) -> torch.Tensor:
    rows = [np.frombuffer(b"".join(pq.read_table(f).column("tokens").to_pylist()), dtype=np.int32)
            for f in sorted(glob.glob(os.path.join(a.data, "*.parquet")))]
    return torch.from_numpy(np.concatenate(rows).reshape(-1, a.seq_len + 1).copy())


def build(a):
    """The model, wrapped as the strategy's library wraps it, and `step(batch)`: one optimizer step on
    this rank's rows of token ids [b, seq_len + 1]; returns the loss, detached."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=a.vocab, n_positions=a.seq_len, n_layer=a.n_layer, n_embd=a.n_embd,
                        n_head=a.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0, use_cache=False)
    model = GPT2LMHeadModel(config)
    if a.init:
        from safetensors.torch import load_model

        load_model(model, a.init)
    bf16 = a.precision == "bf16"
    autocast = contextlib.nullcontext
    if a.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, bucket_cap_mb=a.bucket_cap_mb, gradient_as_bucket_view=True)
        if bf16:
            autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    elif a.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for block in model.transformer.h:
            fully_shard(block, mp_policy=mp, reshard_after_forward=not a.no_reshard_after_forward)
        fully_shard(model, mp_policy=mp)
    if a.strategy.startswith("zero-"):
        import deepspeed
        import deepspeed.ops
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        # DeepSpeed's CPU accelerator would JIT-compile a shared-memory all-reduce that only inference
        # uses (tens of seconds, once): training's collectives go through the torch process group.
        deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
        with open(a.deepspeed_config) as f:
            ds_config = json.load(f)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=tuple(a.betas), eps=a.eps, weight_decay=0.0)
        model, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config,
                                                dist_init_required=False)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=tuple(a.betas), eps=a.eps, weight_decay=0.0)

    def step(batch):
        batch = batch.long()
        with autocast():
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        if a.strategy.startswith("zero-"):
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    return model, step


def main():
    a = parser().parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tokens = read_tokens(a)
    model, train_step = build(a)
    local = a.batch // world
    perm = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(0))

    def step(i):
        return train_step(tokens[perm[i * a.batch + rank * local: i * a.batch + (rank + 1) * local]])

    for i in range(a.warmup):
        step(i)
    dist.barrier()
    block, blocks = a.block or a.steps, []
    t0 = start = time.perf_counter()
    for i in range(a.warmup, a.warmup + a.steps):
        loss = step(i)
        if (i - a.warmup + 1) % block == 0:
            loss.item()  # the block's last step is done
            blocks.append((time.perf_counter() - t0) / block)
            t0 = time.perf_counter()
    loss.item()
    elapsed = time.perf_counter() - start
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"step_time_s": elapsed / a.steps, "block_times_s": blocks, "steps": a.steps,
                       "loss": float(loss)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
