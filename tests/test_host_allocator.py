"""The caching host allocator CPU workers start with (`scaling.host_allocator`, metrics/memory.py):
memory a step frees is taken again by the next step without page faults, also in a thread of its own
(where Ray Train runs the training function); `system` leaves glibc's defaults; the memory benchmark's
`return_freed_memory` undoes it; `returning` gives freed memory back even where glibc's defaults keep it.
Counted in page faults, not seconds: the count does not depend on
what else the machine is doing."""

import json
import os
import platform
import subprocess
import sys

import pytest

from raytrain_par import config, driver
from raytrain_par.metrics.memory import CACHING_ALLOCATOR_ENV, RETURNING_ALLOCATOR_ENV

BASE = {"name": "t", "model": {"name": "gpt2-tiny"}, "data": {"name": "kjv"}, "strategy": {"name": "ddp"},
        "scaling": {"num_workers": 2}, "train": {"global_batch_size": 32, "max_steps": 10, "lr": 1e-3}}

# A GPT-2's logits: 16 rows x 128 tokens x 8192 words in fp32, 64 MiB (16,384 pages), made and freed
# once a step, in a thread as Ray Train runs its training function.
STEPS = """
import json, resource, sys, threading
import torch
from raytrain_par.metrics.memory import return_freed_memory
if sys.argv[1] == "return":
    return_freed_memory()
faults = []
def steps():
    for _ in range(10):  # the first steps grow the heap to what a step takes (glibc: about 8 here)
        x = torch.ones(16, 128, 8192); del x
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        x = torch.ones(16, 128, 8192); del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=steps); t.start(); t.join()
print(json.dumps(faults[0]))
"""
PAGES = 10 * 16 * 128 * 8192 * 4 // 4096  # what ten fresh 64 MiB tensors fault in, 4 KiB a page


def faults_per_ten_steps(env: dict, mode: str = "") -> int:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", STEPS, mode], env={**base, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout)


def test_cpu_workers_start_with_the_caching_allocator_unless_asked_for_the_systems():
    assert CACHING_ALLOCATOR_ENV.items() <= driver.worker_env(config.parse(BASE)).items()
    assert CACHING_ALLOCATOR_ENV.items() <= driver.worker_env().items()  # the shared clusters of tests and jobs
    for scaling in ({"host_allocator": "system"}, {"host_allocator": "returning"}, {"use_gpu": True}):
        spec = config.parse({**BASE, "scaling": {"num_workers": 2, **scaling}})
        assert not set(CACHING_ALLOCATOR_ENV) & set(driver.worker_env(spec)), scaling
        assert (RETURNING_ALLOCATOR_ENV.items() <= driver.worker_env(spec).items()) == (scaling == {"host_allocator": "returning"})


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings (MALLOC_*); no glibc here")
def test_a_step_takes_again_what_the_last_one_freed_without_page_faults():
    system = faults_per_ten_steps({})
    caching = faults_per_ten_steps(CACHING_ALLOCATOR_ENV)
    returned = faults_per_ten_steps(CACHING_ALLOCATOR_ENV, "return")
    print(f"\npage faults in ten 64 MiB steps: system {system}, caching {caching}, caching then returned {returned}")
    # Ratios, not page counts: with transparent huge pages always on, a new 64 MiB mapping faults 32 times.
    assert system >= 20 * (caching + 1)  # every step's tensor is a new mapping; the heap's pages are used again
    assert returned >= 20 * (caching + 1)  # the memory benchmark's peak follows what is in use again
    assert caching < PAGES // 50


def test_an_unknown_allocator_is_refused():
    with pytest.raises(config.ConfigError, match=r"scaling.host_allocator = 'jemalloc'.*\n  fix: .*caching, system, returning"):
        config.parse({**BASE, "scaling": {"num_workers": 2, "host_allocator": "jemalloc"}})


# What a sharded step leaves behind: each unit's whole gradient (8 MiB) made after glibc has raised its
# threshold past it (the first 16 MiB block freed), then its shard, which lives on; the whole ones freed.
HOLES = """
import json, torch
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
first = torch.ones(4 << 20)  # 16 MiB, an mmap of its own: glibc's default threshold rises to it when freed
del first
base = resident()
whole, shards = [], []
for _ in range(20):  # each unit: its whole gradient (8 MiB), then the shard that outlives it (1 MiB)
    whole.append(torch.ones(2 << 20))
    shards.append(torch.ones(1 << 18))
del whole
print(json.dumps(resident() - base))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings (MALLOC_*); no glibc here")
def test_the_returning_allocator_gives_back_what_glibc_would_keep():
    def kept(env):
        base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        out = subprocess.run([sys.executable, "-c", HOLES], env={**base, **env}, capture_output=True, text=True,
                             check=True, timeout=120)
        return json.loads(out.stdout)

    system, returning = kept({}), kept(RETURNING_ALLOCATOR_ENV)
    print(f"\nresident after freeing 160 MiB between live blocks: system {system >> 20} MiB, returning {returning >> 20} MiB")
    assert system >= 100 << 20  # glibc's defaults keep the freed blocks in the heap, resident
    assert returning <= 24 << 20  # the shards in use (20 MiB): each whole one was a mapping of its own, unmapped
