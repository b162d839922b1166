"""Recovery from a lost worker, per strategy: time from the kill to training resumed, and steps
redone (trained again because they came after the last checkpoint).

A run with `train.max_failures: 1` checkpoints every `--checkpoint-every` evaluations; a training
worker is killed with SIGKILL from outside once the run has passed `--kill-after` steps; Ray Train
replaces the worker group and the loop resumes from the latest intact checkpoint.

    python benchmarks/recovery.py [--strategies ddp,zero-3,megatron,pipeline] [--steps 16]
    python benchmarks/recovery.py --elastic [--steps 100]

`--elastic` measures an elastic run (`scaling.num_workers: [1, 2]`) on a two-node cluster on this
machine: a head of its own (`ray start --head`) holds one worker, a second Ray node (`ray start --address`) the other.
Once the run has passed `--kill-after` steps the second node is stopped (its raylet and workers
killed, as a machine that vanishes); training continues on one worker; then the node is started
again and the run grows back to two. It prints the time from the node loss to training resumed, the
steps redone, the time from the node's return to training on two workers, and whether the run ended
with the final validation loss of an uninterrupted fixed run of 2 workers.

Strategies are named as under `strategy.name`; the model-parallel ones run with 2-way splits
(`megatron`: tensor_parallel 2, `pipeline`: 2 stages with the 1F1B schedule).
"""

from __future__ import annotations

import argparse
import itertools
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import psutil
import ray
from common import markdown_table, print_table, write_json, write_page
from ray.util.state import list_actors

from raytrain_par.config import load_experiment
from raytrain_par.driver import run_experiment, start_local_cluster, worker_env
from raytrain_par.metrics.records import read_records


# The strategy block of each measured strategy (on the default 2 workers).
STRATEGIES = {
    "ddp": "{name: ddp}",
    "zero-1": "{name: zero-1}",
    "zero-2": "{name: zero-2}",
    "zero-3": "{name: zero-3}",
    "fsdp": "{name: fsdp}",
    "megatron": "{name: megatron, tensor_parallel: 2}",
    "pipeline": "{name: pipeline, stages: 2, schedule: 1f1b}",
}


def measure(strategy: str, a, work: Path) -> dict:
    spec = load_experiment(a.experiment, [
        f"strategy={STRATEGIES[strategy]}", f"scaling.num_workers={a.workers}", f"train.max_steps={a.steps}",
        "train.eval_every_steps=2", f"train.checkpoint_every_evals={a.checkpoint_every}", "train.max_failures=1",
        "train.lr_schedule=constant", "train.warmup_steps=0", "data.max_val_samples=16",
        f"output_dir={work / strategy}"])
    done = {}
    thread = threading.Thread(target=lambda: done.update(result=run_experiment(spec, log=lambda *_: None)))
    thread.start()
    metrics = work / strategy / spec.name / "metrics.parquet"
    before = []
    while not before and thread.is_alive():
        time.sleep(0.1)
        if metrics.exists():
            before = [r for r in read_records(metrics) if r["step"] >= a.kill_after]
    workers = list_actors(address=ray.get_runtime_context().gcs_address,
                          filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    t_kill = time.time()
    os.kill(workers[-1]["pid"], signal.SIGKILL)
    thread.join()
    records = done["result"].records
    after = min((r for r in records if r.get("resumed_from_step") is not None), key=lambda r: r["step"])
    at_kill = step_at(t_kill, records)
    return {"strategy": strategy, "killed_at_step": at_kill, "resumed_from_step": after["resumed_from_step"],
            "steps_redone": max(0, at_kill - after["resumed_from_step"]),
            "recovery_s": after["started_at"] - t_kill, "completed": done["result"].error is None,
            "final_step": records[-1]["step"]}


def start_head(cpus: int, work: Path) -> subprocess.Popen:
    """A Ray head of this machine's own (`ray start --head`) that other nodes can join: an embedded
    cluster listens on the loopback address only, which a second node cannot reach. Its processes run
    in a session of their own, which `stop_node` ends. This process then connects to it, with the token
    `with_token` set."""
    from raytrain_par.local_group import free_port

    address = f"{ray.util.get_node_ip_address()}:{free_port()}"
    # RAY_ADDRESS in the nodes' processes: Ray Train's placement-group cleaner looks the cluster up
    # without an address, and would find another one of this machine.
    os.environ["RAY_ADDRESS"] = address
    log = work / "head.log"
    with open(log, "ab") as out:
        head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                                 "--disable-usage-stats", f"--port={address.rpartition(':')[2]}", f"--num-cpus={cpus}",
                                 "--dashboard-host=127.0.0.1"], env=os.environ, start_new_session=True,
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while True:
        try:
            ray.init(address=address, runtime_env={"env_vars": worker_env()}, logging_level="ERROR")
            return head
        except (ConnectionError, RuntimeError):
            if head.poll() is not None or time.time() > deadline:
                stop_node(head)
                raise RuntimeError(f"the Ray head at {address} did not start within 120 s{_tail(log)}") from None
            time.sleep(1)


def forget_head(address: str) -> None:
    """`ray start --head` records the head as this machine's current cluster (Ray's address file, which
    a later `ray.init()` without an address joins); killed, it cannot take that back itself."""
    from raytrain_par.ray_private import ray_address_file

    recorded = Path(ray_address_file())
    if recorded.exists() and recorded.read_text().strip() == address:
        recorded.unlink()


def with_token() -> None:
    """Token authentication for the head, its nodes and this process: a new token in a file of its own.
    Ray reads its authentication settings once, as it is imported, so this process starts again with
    them set (the nodes inherit them)."""
    if os.environ.get("RAYTRAIN_PAR_RECOVERY_TOKEN"):
        return
    token = Path(tempfile.mkdtemp(prefix="raytrain-par-recovery-token-")) / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "RAYTRAIN_PAR_RECOVERY_TOKEN": "1"}
    env.pop("RAY_AUTH_TOKEN", None)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def start_node(cpus: int, work: Path) -> subprocess.Popen:
    """A second Ray node on this machine, joined to the running cluster; `ray start`'s output goes to
    node.log in `work`, quoted if the node does not join."""
    log = work / "node.log"
    with open(log, "ab") as out:
        node = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
                                 f"--address={ray.get_runtime_context().gcs_address}", f"--num-cpus={cpus}"],
                                env=os.environ, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while len([n for n in ray.nodes() if n["Alive"]]) < 2:
        if node.poll() is not None or time.time() > deadline:
            stop_node(node)
            raise RuntimeError(f"the second Ray node did not join the cluster within 120 s{_tail(log)}")
        time.sleep(0.2)
    return node


def _tail(log: Path, lines: int = 20) -> str:
    text = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else []
    return f"; the end of {log}:\n" + "\n".join(text) if text else f" (nothing in {log})"


def stop_node(node: subprocess.Popen) -> None:
    """Kill the node's raylet and the workers on it at once, as a lost machine: its process group and
    every process below it (a worker outside the group would otherwise train on until it noticed its
    raylet gone)."""
    try:
        below = psutil.Process(node.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    try:
        os.killpg(node.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it has ended already
    for process in below:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    node.wait()


def runs(values: list) -> str:
    """[2, 2, 1, 1, 1] -> '2 x2, 1 x3'."""
    return ", ".join(f"{v} x{len(list(same))}" for v, same in itertools.groupby(values))


def step_at(t: float, records: list[dict]) -> int:
    """The step a run was at when time `t` came: estimated from the last evaluation before it and its
    step time, and at least the last step the worker group of that time went on to record."""
    last = max((r for r in records if r["timestamp"] <= t), key=lambda r: r["step"])
    estimate = last["step"] + int((t - last["timestamp"]) / (last["step_time_s"] or 1))
    return max([estimate] + [r["step"] for r in records if r["started_at"] <= t])


def _wait_for(metrics: Path, thread: threading.Thread, test) -> list[dict]:
    while thread.is_alive():
        found = [r for r in read_records(metrics) if test(r)] if metrics.exists() else []
        if found:
            return found
        time.sleep(0.1)
    return []


def measure_elastic(a, work: Path) -> dict:
    common = [f"train.max_steps={a.steps}", "train.eval_every_steps=2", "train.checkpoint_every_evals=1",
              "train.lr_schedule=constant", "train.warmup_steps=0", "train.grad_clip=0.0", "data.max_val_samples=16",
              f"scaling.cpus_per_worker={a.node_cpus}"]
    fixed = load_experiment(a.experiment, [*common, "scaling.num_workers=2", f"output_dir={work / 'fixed'}"])
    spec = load_experiment(a.experiment, [*common, "scaling.num_workers=[1, 2]", "scaling.resize_interval_s=2",
                                          "train.max_failures=1", f"output_dir={work / 'elastic'}"])
    node = start_node(a.node_cpus, work)
    try:
        reference = run_experiment(fixed, log=lambda *_: None).records
        done = {}
        thread = threading.Thread(target=lambda: done.update(result=run_experiment(spec, log=lambda *_: None)))
        thread.start()
        metrics = work / "elastic" / spec.name / "metrics.parquet"
        before = _wait_for(metrics, thread, lambda r: r["step"] >= a.kill_after and r["num_workers"] == 2)
        if not before:
            raise RuntimeError(f"the elastic run ended before training {a.kill_after} steps on 2 workers")
        t_loss = time.time()
        stop_node(node)
        shrunk = _wait_for(metrics, thread, lambda r: r["num_workers"] == 1 and r["timestamp"] > t_loss)
        t_back = time.time()
        node = start_node(a.node_cpus, work)
        grown = _wait_for(metrics, thread, lambda r: r["num_workers"] == 2 and r["timestamp"] > t_back)
        thread.join()
    finally:
        if node.poll() is None:
            stop_node(node)
    records = done["result"].records
    resumed = min((r for r in records if r.get("resumed_from_step") is not None and r["started_at"] > t_loss),
                  key=lambda r: r["step"])
    at_loss = step_at(t_loss, records)
    return {"strategy": "ddp, elastic [1, 2]", "node_lost_at_step": at_loss,
            "resumed_from_step": resumed["resumed_from_step"],
            "steps_redone": max(0, at_loss - resumed["resumed_from_step"]),
            "recovery_s": resumed["started_at"] - t_loss, "shrunk": bool(shrunk),
            "grow_s": (min(r["started_at"] for r in grown) - t_back) if grown else None,
            "workers": [r["num_workers"] for r in records], "completed": done["result"].error is None,
            "steps_match": [r["step"] for r in records] == [r["step"] for r in reference],
            "final_val_loss": records[-1]["val_loss"], "fixed_final_val_loss": reference[-1]["val_loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="experiments/quickstart.yaml")
    p.add_argument("--strategies", default="ddp,zero-3,megatron,pipeline",
                   help=f"comma-separated, of: {', '.join(STRATEGIES)}")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, help="steps of each run (default 16; --elastic: 100, so that the run outlasts the node's return, about 30-45 s)")
    p.add_argument("--kill-after", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=2, help="evaluations (every 2 steps) per checkpoint")
    p.add_argument("--elastic", action="store_true", help="measure an elastic run losing a node and regaining it")
    p.add_argument("--node-cpus", type=int, default=2, help="--elastic: CPUs of each node, and of each worker")
    p.add_argument("--out", help="the JSON file (default benchmarks/results/recovery[-elastic].json)")
    p.add_argument("--page", help="the docs page (default docs/recovery[-elastic].md)")
    a = p.parse_args()
    a.steps = a.steps or (100 if a.elastic else 16)
    if a.elastic:
        with_token()
        # The head holds one worker (and a CPU for Ray Data); the second node the other.
        work = Path(tempfile.mkdtemp(prefix="raytrain-par-recovery-"))
        head = start_head(a.node_cpus + 1, work)
        try:
            r = measure_elastic(a, work)
        except BaseException:
            # Printed now: shutting Ray down under a training thread that is still running ends this
            # process before the traceback would be.
            traceback.print_exc()
            raise
        finally:
            ray.shutdown()
            stop_node(head)
            forget_head(os.environ["RAY_ADDRESS"])
        head = ["run", "node lost at step", "resumed from", "steps redone", "loss -> training (s)",
                "return -> 2 workers (s)", "workers per evaluation (x times)", "final val_loss (fixed run)"]
        rows = [[r["strategy"], r["node_lost_at_step"], r["resumed_from_step"], r["steps_redone"],
                 f"{r['recovery_s']:.1f}", "-" if r["grow_s"] is None else f"{r['grow_s']:.1f}",
                 runs(r["workers"]), f"{r['final_val_loss']:.6f} ({r['fixed_final_val_loss']:.6f})"]]
        print_table(head, rows)
        print(f"written {write_json('recovery-elastic', {'rows': [r], 'steps': a.steps}, a.out)}")
        same = abs(r["final_val_loss"] - r["fixed_final_val_loss"]) <= 1e-5 * abs(r["fixed_final_val_loss"])
        page = write_page("recovery-elastic", "Elastic training: a node lost and regained", f"""
An elastic run (`scaling.num_workers: [1, 2]`, the quickstart model, {a.steps} steps, an evaluation and a
checkpoint every 2 steps) on two Ray nodes of this machine, one worker each. After step {a.kill_after} the
second node is killed (its raylet and workers, as a machine that vanishes); once training goes on with
one worker the node is started again, and the run grows back to two. Ray's defaults throughout
(`RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S` 60 s: after the loss, Ray Train first asks again for two
workers until that runs out; see [failures.md](failures.md#elastic-training-num_workers-min-max)).

{markdown_table(head, rows)}

Every step was trained once and recorded once: {"yes" if r["steps_match"] else "NO"} (the evaluations' steps
equal the fixed run's). Final validation loss equal to the uninterrupted fixed run of 2 workers within
1e-5 relative: {"yes" if same else "NO"}. Completed: {"yes" if r["completed"] else "NO"}.
""", a.page)
        print(f"written {page}")
        return
    unknown = [s for s in a.strategies.split(",") if s not in STRATEGIES]
    if unknown:
        p.error(f"--strategies: unknown {unknown[0]!r}; use some of {', '.join(STRATEGIES)}")
    start_local_cluster(num_cpus=a.workers + 1, env=worker_env())
    work = Path(tempfile.mkdtemp(prefix="raytrain-par-recovery-"))
    rows = [measure(s, a, work) for s in a.strategies.split(",")]
    head = ["strategy", "killed at step", "resumed from", "steps redone", "kill -> training (s)", "completed"]
    table = [[r["strategy"], r["killed_at_step"], r["resumed_from_step"], r["steps_redone"], f"{r['recovery_s']:.1f}",
              "yes" if r["completed"] else "NO"] for r in rows]
    print_table(head, table)
    print(f"written {write_json('recovery', {'rows': rows, 'steps': a.steps, 'workers': a.workers}, a.out)}")
    page = write_page("recovery", "Recovery from a lost worker", f"""
A training worker is killed (SIGKILL from outside) after step {a.kill_after} of a {a.steps}-step run of the
quickstart model on {a.workers} workers, with an evaluation every 2 steps and a checkpoint every
{a.checkpoint_every} evaluations (`train.max_failures: 1`): the time from the kill to training resumed,
and the steps trained again (those after the latest checkpoint). The model-parallel strategies run
2-way: megatron `tensor_parallel: 2`, pipeline 2 stages with 1F1B.

{markdown_table(head, table)}

Most of the time to resume is Ray Train starting a new worker group (processes, process group, the
data set) and loading the checkpoint.
""", a.page)
    print(f"written {page}")

if __name__ == "__main__":
    main()
