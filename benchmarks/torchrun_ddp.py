"""Plain PyTorch DDP training of a GPT-2 on prepared KJV shards, for `torchrun`: the baseline that
benchmarks/overhead.py compares raytrain-par's DDP under Ray against. Deliberately written with
torch, transformers and pyarrow only — no raytrain-par code in the timed loop.

    torchrun --nproc_per_node 2 benchmarks/torchrun_ddp.py --data DIR --seq-len 128 --vocab 8192 \
        --n-layer 2 --n-embd 128 --n-head 4 --batch 32 --warmup 5 --steps 30 --out result.json
"""

import argparse
import glob
import json
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel


def main():
    p = argparse.ArgumentParser()
    for name, typ in [("data", str), ("seq-len", int), ("vocab", int), ("n-layer", int), ("n-embd", int),
                      ("n-head", int), ("batch", int), ("warmup", int), ("steps", int), ("out", str)]:
        p.add_argument(f"--{name}", type=typ, required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    rows = [np.frombuffer(b"".join(pq.read_table(f).column("tokens").to_pylist()), dtype=np.int32)
            for f in sorted(glob.glob(os.path.join(a.data, "*.parquet")))]
    tokens = torch.from_numpy(np.concatenate(rows).reshape(-1, a.seq_len + 1).copy())

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=a.vocab, n_positions=a.seq_len, n_layer=a.n_layer, n_embd=a.n_embd,
                        n_head=a.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    model = DistributedDataParallel(GPT2LMHeadModel(config), gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    local = a.batch // world
    perm = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(0))

    def step(i):
        idx = perm[i * a.batch + rank * local: i * a.batch + (rank + 1) * local]
        batch = tokens[idx].long()
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(a.warmup):
        step(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(a.warmup, a.warmup + a.steps):
        loss = step(i)
    loss.item()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"step_time_s": elapsed / a.steps, "steps": a.steps, "loss": float(loss)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
