"""raytrain-par: compare ways of parallelising training on a Ray cluster.

    raytrain-par run EXPERIMENT.yaml [--address ADDR] [--set key=value ...] [--resume]
    raytrain-par sweep EXPERIMENT.yaml [--address ADDR] [--set ...] [--resume]   Ray Tune over its sweep block
    raytrain-par plan EXPERIMENT.yaml [--set ...] [--device-memory 80GiB]   predicted time-to-target of every sweep point
                 [--probe-workers 1] | [--cluster FILE | --device NAME] [--workers 8..256] [--records DIR] [--price USD]
    raytrain-par report RESULTS_DIR [--out DIR]         figures and a ranked summary of a run or sweep
    raytrain-par check EXPERIMENT.yaml [--set ...]      validate and print the resolved experiment
    raytrain-par data EXPERIMENT.yaml                   prepare (and cache) the experiment's data set
    raytrain-par cluster validate [FILES] [--experiment X.yaml ...]   check cluster YAMLs offline
    raytrain-par estimate EXPERIMENT.yaml [--workers 1,2,4,8] [--device-memory 80GiB] [--strategies ...]
                 [--device NAME | --cluster FILE] [--records RUN_DIR] [--price USD]
                                                        per-worker memory of each strategy, before launching; step
                                                        time on a device; time and cost to the target
    raytrain-par export RUN_DIR --out DIR               the plain model of a run's latest checkpoint
    raytrain-par reproduce [FINDING ...] [--paper] [--list]   the study's findings, a page each
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
from pathlib import Path

import yaml

from .errors import UserError


# One example per command, shown by `raytrain-par COMMAND --help`.
EXAMPLES = {
    "run": "raytrain-par run experiments/quickstart.yaml --set train.max_steps=20",
    "sweep": "raytrain-par sweep experiments/sweep-workers-batch.yaml",
    "plan": "raytrain-par plan experiments/sweep-workers-batch.yaml",
    "report": "raytrain-par report results/quickstart",
    "check": "raytrain-par check experiments/quickstart.yaml --set strategy.name=zero-2",
    "data": "raytrain-par data experiments/vgg-fashion.yaml",
    "cluster": "raytrain-par cluster validate clusters/aws-a100.yaml --experiment experiments/paper/gpt2-medium-wikitext.yaml",
    "estimate": "raytrain-par estimate experiments/zero-memory.yaml --workers 1,2,4,8 --device-memory 80GiB",
    "export": "raytrain-par export results/quickstart --out gpt2-quickstart",
    "reproduce": "raytrain-par reproduce identical-curves zero-memory",
}


def versions() -> dict:
    """What a bug report needs: this package's version and those of the libraries it trains with."""
    from importlib import metadata

    out = {}
    for dist in ("raytrain-par", "torch", "ray", "deepspeed", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
        out["gpus"] = torch.cuda.device_count() if torch.version.cuda else 0
    except Exception:  # a broken torch install is reported as such, not as a traceback
        out["cuda"], out["gpus"] = None, 0
    return out


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        v = versions()
        libs = ", ".join(f"{k} {v[k] or 'not installed'}" for k in ("torch", "ray", "deepspeed", "transformers"))
        cuda = f"CUDA {v['cuda']}, {v['gpus']} GPU(s) visible" if v["cuda"] else "no CUDA (CPU build of torch)"
        print(f"raytrain-par {v['raytrain-par']} ({libs}; {cuda})")
        parser.exit(0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raytrain-par", description=__doc__.split("\n\n")[0],
                                epilog="start with: " + EXAMPLES["run"] + "\n(activate the environment first: "
                                ". .venv/bin/activate)", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_Version, help="print the versions of raytrain-par, torch, ray, deepspeed "
                   "and transformers, and CUDA's where there is one, and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, **kw):
        return sub.add_parser(name, description=kw.get("help"), epilog=f"example:\n  {EXAMPLES[name]}",
                              formatter_class=argparse.RawDescriptionHelpFormatter, **kw)

    def experiment_args(sp):
        sp.add_argument("experiment", help="experiment YAML file")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. --set train.epochs=3 (repeatable; value read as YAML)")

    def json_arg(sp):
        sp.add_argument("--json", action="store_true", help="print one JSON document on stdout (its `schema` "
                        "field versions its keys; docs/cli.md lists them) and everything else on stderr")

    run = add("run", help="train one experiment on a Ray cluster")
    experiment_args(run)
    run.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster)")
    run.add_argument("--resume", action="store_true", help="continue the experiment's last run from its latest checkpoint")

    sweep = add("sweep", help="run every trial of the experiment's sweep block with Ray Tune")
    experiment_args(sweep)
    sweep.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster)")
    sweep.add_argument("--resume", action="store_true", help="continue an interrupted sweep")

    plan = add("plan", help="predict every sweep point's time to the target from one reference run and short "
               "throughput probes, and rank them")
    experiment_args(plan)
    plan.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster)")
    plan.add_argument("--device-memory", help="memory of one device (e.g. 80GiB): flags points that do not fit")
    plan.add_argument("--probe-workers", help="probe only these worker counts (e.g. 1); the step at the others comes "
                      "from the step-time model (raytrain-par estimate's), calibrated on those probes")
    device_args(plan, "rank the points on", "an earlier run of this experiment (or plan) to take the reference "
                "from, instead of training one")
    plan.add_argument("--workers", help="with --cluster or --device: the worker counts to rank, e.g. 8,16,64 or "
                      "8..256 (powers of two; default: the sweep's)")
    json_arg(plan)

    report = add("report", help="write figures and a ranked Markdown summary of a run or sweep")
    report.add_argument("results", help="results directory of an experiment, e.g. results/quickstart")
    report.add_argument("--out", help="where to write (default: the results directory)")
    report.add_argument("--to-mlflow", metavar="URI", help="also push every record, the summary and the figures "
                        "to this MLflow tracking server (new MLflow runs in an experiment of the run's name)")
    json_arg(report)

    check = add("check", help="validate an experiment (and its sweep block, as `sweep` would) and print it with "
                "every default filled in")
    experiment_args(check)
    json_arg(check)

    prep = add("data", help="prepare the experiment's data set into the cache")
    experiment_args(prep)

    cluster = add("cluster", help="work with the cluster files in clusters/")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    validate = cluster_sub.add_parser(
        "validate", help="check cluster-launcher YAMLs and KubeRay manifests offline (Ray's schema, structure, "
        "open ports, credentials) and whether they hold the given experiments")
    validate.add_argument("files", nargs="*", help="cluster files (default: every YAML in clusters/)")
    validate.add_argument("--experiment", dest="experiments", action="append", default=[], metavar="X.yaml",
                          help="experiment (or sweep) the cluster must hold (repeatable)")
    est = add("estimate", help="predict per-worker memory of each strategy and worker count, and on a named "
              "device its step time, throughput and MFU")
    experiment_args(est)
    est.add_argument("--workers", help="worker counts, e.g. 1,2,4,8 (default: the sweep's, else the experiment's)")
    est.add_argument("--strategies", help="strategies, e.g. ddp,zero-3 (default: every strategy that can say)")
    est.add_argument("--device-memory", help="memory of one device (e.g. 80GiB): flags what does not fit "
                     "(default: --device's)")
    device_args(est, "predict step times on", "a reference run of this experiment (results/<name>, or a plan's "
                "directory): adds the time to the target, from its gradient noise scale")
    json_arg(est)

    exp = add("export", help="write the plain model of a run's latest checkpoint")
    exp.add_argument("run_dir", help="results directory of a run (results/<experiment>) or a checkpoint")
    exp.add_argument("--out", required=True, help="directory to write the model into")
    exp.add_argument("--max-shard-size", default="5GB", help="largest weights file; a larger model is written in "
                     "shards with model.safetensors.index.json, as Hugging Face's (default: 5GB)")

    rep = add("reproduce", help="run findings of the study and write a page per finding (held or not, with the "
              "numbers); all of them when none is named")
    rep.add_argument("findings", nargs="*", metavar="FINDING", help="e.g. identical-curves (see --list)")
    rep.add_argument("--list", action="store_true", help="name the findings, what each runs and how long it took here")
    rep.add_argument("--paper", action="store_true", help="the study's sizes (experiments/paper/), for a GPU cluster")
    rep.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster)")
    rep.add_argument("--out", help="where the pages go (default: docs/results where the current directory has "
                     "one, as a checkout does, else reproduce/; their paper/ with --paper)")
    rep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a field of every finding's experiment, e.g. --set data.path=/data/wikitext-103")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and not argv[0].startswith("-") and argv[0] not in EXAMPLES:
        close = difflib.get_close_matches(argv[0], list(EXAMPLES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"raytrain-par: error: unknown command {argv[0]!r}{hint}\n  commands: {', '.join(EXAMPLES)}; "
              "`raytrain-par --help` says what each does", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv)
    try:
        if getattr(args, "json", False):
            return _as_json(args)
        return _dispatch(args)
    except UserError as e:
        print(f"raytrain-par: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("raytrain-par: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # not the user's input: a bug, said in one line unless asked for its traceback
        if os.environ.get("RAYTRAIN_PAR_DEBUG"):
            raise
        print(f"raytrain-par: internal error: {type(e).__name__}: {e}\n  this is a bug in raytrain-par, not in "
              "your input: please report it with the command and `raytrain-par --version`; RAYTRAIN_PAR_DEBUG=1 "
              "prints where it happened", file=sys.stderr)
        return 1


JSON_SCHEMA = 1  # raised when a key of a --json document changes meaning or goes; new keys keep it


def _as_json(args) -> int:
    """Run the command with everything it prints sent to stderr (file descriptor 1 as well: Ray and
    the libraries it starts write there), then print its one JSON document on stdout. An error is a
    document too, with the exit status 2, and its message on stderr as always."""
    sys.stdout.flush()
    saved, real = os.dup(1), sys.stdout
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        rc, doc = _dispatch(args)
    except UserError as e:
        print(f"raytrain-par: error: {e}", file=sys.stderr)
        rc, doc = 2, {"error": str(e)}
    finally:
        sys.stdout.flush()
        sys.stdout = real
        os.dup2(saved, 1)
        os.close(saved)
    print(json.dumps({"schema": JSON_SCHEMA, "command": args.command, **_plain(doc)}, indent=1, allow_nan=False))
    return rc


def _plain(value):
    """A value as JSON holds it: dataclasses and paths as their fields and text, NumPy numbers as
    numbers, NaN and infinities (a point that never reaches the target) as null."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy and torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _emit(args, text: str | None, doc: dict, rc: int = 0):
    """What a command gives back: its text, printed here unless --json asked for the document."""
    if not getattr(args, "json", False):
        if text is not None:
            print(text)
        return rc
    return rc, doc


def _dispatch(args):
    from .config import load_experiment

    if args.command == "cluster":
        return _cluster_validate(args.files, args.experiments)
    if args.command == "report":
        from .report import write_report

        written = write_report(args.results, args.out)
        if args.to_mlflow:
            _push_to_mlflow(Path(args.results), args.to_mlflow)
        return _emit(args, "\n".join(f"written {f}" for f in written),
                     {"results": str(Path(args.results).resolve()), "files": [str(f) for f in written.files],
                      "metric": written.metric, "target": written.target, "mode": written.mode,
                      "trials": written.trials})
    if args.command == "reproduce":
        from .reproduce import main as reproduce

        return reproduce(args)
    if args.command == "export":
        from .export import export

        export(args.run_dir, args.out, args.max_shard_size)
        return 0
    spec = load_experiment(args.experiment, args.overrides, check_data=args.command != "estimate")
    swept = None
    if spec.sweep is not None:  # whatever the verb, a sweep block is read as `sweep` reads it
        from .sweep import plan

        swept = plan(spec)  # every trial it implies is a valid experiment, before Ray starts
    if args.command == "check":
        from . import summary

        sweep_summary = summary.sweep_summary(swept, spec) if swept else None
        run = summary.run_summary(spec)
        text = yaml.safe_dump(spec.to_dict(), sort_keys=False) + "\n".join(summary.lines(run, sweep_summary))
        return _emit(args, text, {"source": str(Path(args.experiment).resolve()), "experiment": spec.to_dict(),
                                  "summary": run, "sweep": sweep_summary})
    if args.command == "data":
        from . import data

        info = data.prepare(spec.data, spec.data.cache_dir)
        print(f"{info.name}: {info.num_train} training rows, {info.num_val} validation rows in "
              f"{info.train_path.rsplit('/', 1)[0]}")
        return 0
    if args.command == "sweep":
        from .sweep import plan
        from .tuning import run_sweep

        if swept is None:
            plan(spec)  # says that there is no sweep block, and how to write one
        result = run_sweep(spec, address=args.address, resume=args.resume)
        return 1 if any(t["status"] == "failed" for t in result.trials) else 0
    if args.command == "estimate":
        return _estimate(spec, args)
    if args.command == "plan":
        return _plan(spec, args)
    from .driver import run_experiment

    result = run_experiment(spec, address=args.address, resume=args.resume)
    return 1 if result.error is not None else 0


def _push_to_mlflow(results: Path, uri: str) -> None:
    from .tracking import MLflowSpec, TrackingSpec, missing_package, push_results

    if missing_package("mlflow"):
        raise UserError(f"--to-mlflow {uri}: the mlflow package is not installed.\n  fix: pip install "
                        "'raytrain-par[mlflow]' (or pip install mlflow)")
    failures = []
    pushed = push_results(results, TrackingSpec(mlflow=MLflowSpec(tracking_uri=uri)), warn=failures.append)
    if failures:
        raise UserError(f"--to-mlflow {uri}: {failures[0].removeprefix('raytrain-par: warning: ')}\n  fix: start "
                        f"the server (mlflow server --backend-store-uri sqlite:///mlflow.db) or correct the URI")
    runs = [t for t in pushed.state.get("mlflow", {}) if t != "__sweep__"]
    print(f"pushed {len(runs)} MLflow run(s) to {uri}", file=sys.stderr)


def _cluster_validate(files: list[str], experiments: list[str]) -> int:
    from .clusters import default_files, validate

    results = validate(files or default_files(), experiments)
    for c in results:
        if c.ok:
            types = "; ".join(t.describe() for t in c.node_types)
            print(f"{c.path}: ok ({c.kind}: {types})" + (f"; holds {', '.join(experiments)}" if experiments else ""))
        for note in c.notes:
            print(f"{c.path}: note: {note}")
        for problem in c.problems:
            print(f"raytrain-par: error: {problem}", file=sys.stderr)
    bad = [c for c in results if not c.ok]
    if bad:
        print(f"{len(bad)} of {len(results)} cluster file(s) have problems", file=sys.stderr)
    return 2 if bad else 0


def device_args(parser, what: str, records: str) -> None:
    """The options that name a device nothing here runs on (`estimate`, `plan`) and price its time."""
    parser.add_argument("--device", help=f"{what} this device: one of " + ", ".join(_device_names()))
    parser.add_argument("--gpus-per-node", type=int, help="accelerators per node (default: the device's node)")
    parser.add_argument("--set-device", dest="device_overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a figure of the device, e.g. inter_node_bw=12.5 (GB/s) or achievable=0.4")
    parser.add_argument("--cluster", help=f"{what} the GPU machines of this cluster file (e.g. "
                        "clusters/aws-a100.yaml): their GPU, node, network, price and how many GPUs it holds")
    parser.add_argument("--records", metavar="DIR", help=records)
    parser.add_argument("--price", type=float, metavar="USD", help="price of one GPU-hour (default: the --cluster "
                        "machine's on-demand price): adds the cost to the target")


def _price(args, price: float | None) -> float | None:
    """--price where given (checked), else `price` (the cluster's)."""
    if args.price is None:
        return price
    if not args.price > 0:
        raise UserError(f"--price {args.price:g}: must be positive.\n  fix: the price of one GPU-hour in USD, "
                        "e.g. --price 4.10")
    return args.price


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UserError(f"{option} {text!r}: expected positive integers separated by commas.\n  fix: e.g. {option} 1,2,4,8")
    return values


def _device_names() -> list[str]:
    from .devices import NAMES

    return list(NAMES)


def _device(args):
    """(device, USD per GPU-hour, clusters.GpuNodes): --device with --gpus-per-node and --set-device applied
    (no price, no cluster), or --cluster's GPU machine; Nones where neither is given."""
    from .devices import device

    overrides = {}
    for item in args.device_overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--set-device {item!r}: expected FIELD=VALUE.\n  fix: e.g. --set-device inter_node_bw=12.5")
        overrides[key.strip()] = value.strip()
    if getattr(args, "cluster", None):
        from .devices import cluster_device

        if args.device is not None or args.gpus_per_node is not None:
            raise UserError(f"--cluster {args.cluster} names the device and its node; --device and --gpus-per-node "
                            "would contradict it.\n  fix: drop them (--set-device FIELD=VALUE changes a figure)")
        return cluster_device(args.cluster, overrides)
    if args.device is None:
        if overrides or args.gpus_per_node is not None:
            raise UserError("--set-device and --gpus-per-node change a --device, and none is named.\n"
                            f"  fix: add --device, one of {', '.join(_device_names())}")
        return None, None, None
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise UserError(f"--gpus-per-node {args.gpus_per_node}: must be at least 1.\n  fix: e.g. --gpus-per-node 8")
    return device(args.device, overrides, args.gpus_per_node), None, None


def _estimate(spec, args) -> int:
    from . import estimate, strategies
    from .config import ScalingSpec

    if args.workers:
        workers = _int_list(args.workers, "--workers")
    else:
        swept = (spec.sweep or {}).get("grid", {}).get("scaling.num_workers")
        # every count a run may train on: an elastic range [MIN, MAX] any count in it
        scalings = [ScalingSpec.from_raw({"num_workers": w}) for w in swept] if isinstance(swept, list) \
            else [spec.scaling]
        workers = sorted({n for s in scalings for n in s.worker_counts})
    if args.strategies:
        names = [n.strip() for n in args.strategies.split(",") if n.strip()]
        unknown = [n for n in names if n not in strategies.NAMES]
        if unknown:
            raise UserError(f"--strategies: unknown strategy {unknown[0]!r}.\n  fix: use some of: {', '.join(strategies.NAMES)}")
    else:
        names = list(strategies.NAMES)
    device, price, nodes = _device(args)
    if device is not None:
        device.peak(spec.train.precision)  # a precision the device lacks is refused before anything is sized
    price = _price(args, price)
    target = None
    if args.records:
        if device is None:
            raise UserError(f"--records {args.records}: the time to the target needs step times.\n  fix: add --device "
                            f"NAME (one of {', '.join(_device_names())}) or --cluster FILE")
        target = estimate.to_target(spec, args.records, price)
    elif args.price is not None:
        raise UserError("--price prices the time to the target, which --records gives.\n  fix: add --records DIR "
                        "(a run of this experiment that reached its target)")
    device_memory = estimate.parse_size(args.device_memory) if args.device_memory else None
    if device_memory is None and device is not None:
        device_memory = int(device.memory_bytes)
    rows = estimate.estimate(spec, names, [w for w in workers if nodes is None or not nodes.too_small_for(w)], device)
    if nodes is not None:
        rows += [estimate.Row(n, w, rows[0].params if rows else 0, 0, 0, 0, 0, 0,
                              note=f"not possible: {nodes.too_small_for(w)}")
                 for n in names for w in workers if nodes.too_small_for(w)]
        rows.sort(key=lambda r: (names.index(r.strategy), r.workers))
    params = rows[0].params if rows else 0
    doc = {"experiment": spec.name, "model": spec.model.name, "parameters": params,
           "optimizer": spec.train.optimizer, "precision": spec.train.precision,
           "global_batch_size": spec.train.global_batch_size,
           "activation_checkpointing": spec.train.activation_checkpointing, "device_memory_bytes": device_memory,
           "device": None if device is None else dataclasses.asdict(device),
           "cluster": None if nodes is None else {"file": str(nodes.path), "node_type": nodes.node_type,
                                                  "instance": nodes.instance, "gpus_per_node": nodes.gpus_per_node,
                                                  "max_gpus": nodes.max_gpus, "spot_also": nodes.spot_also},
           "usd_per_gpu_hour": price,
           "reference": None if target is None else {
               "records": target.source, "target": str(spec.target), "global_batch_size": target.reference.batch,
               "steps_to_target": target.reference.steps, "min_steps": target.reference.min_steps,
               "grad_noise_scale": target.reference.noise_scale},
           "rows": [estimate.row_document(r, device_memory, device, target) for r in rows]}
    if getattr(args, "json", False):
        return 0, doc
    print(f"{spec.name}: {spec.model.name}, {params / 1e6:.1f}M parameters, {spec.train.optimizer}, "
          f"{spec.train.precision}, global batch {spec.train.global_batch_size}"
          + (f", activation checkpointing {spec.train.activation_checkpointing}"
             if spec.train.activation_checkpointing != "none" else "")
          + (f", device memory {args.device_memory}" if args.device_memory else ""))
    if device is not None:
        print(f"device {device.describe()}")
    if nodes is not None:
        print(f"cluster {nodes.path}: {nodes.node_type} ({nodes.instance}, {nodes.gpus_per_node} GPUs a node), at most "
              f"{nodes.max_gpus} GPUs" + (f"; ${price:.2f} per GPU-hour on demand" if price is not None else ""))
        if nodes.spot_also:
            print("  its spot node type runs the same machines for less, and may be taken back: price the time to the "
                  "target at your spot rate with --price USD_PER_GPU_HOUR")
    if target is not None:
        ref, t = target.reference, spec.train
        print(f"reference {target.source}: {spec.target} after {ref.steps:.0f} steps at batch {ref.batch}; gradient "
              f"noise scale {ref.noise_scale:.1f}, so {ref.steps_to_target(t.global_batch_size, t.lr, t.optimizer):.0f} "
              f"steps at batch {t.global_batch_size} (lr {t.lr:.3g})")
    print(estimate.table(rows, device_memory, device, target))
    if device is not None:
        print("step (s) = compute + comm (what no computation hides) + bubble; figures and their sources: "
              "raytrain-par estimate --json, under 'device'")
    if target is not None:
        print(estimate.best_to_target(rows, device_memory, target))
    return 0


def _plan(spec, args) -> int:
    from . import estimate
    from .goodput import cluster_plan, make_plan, plan_table, worker_counts

    device_memory = estimate.parse_size(args.device_memory) if args.device_memory else None
    probe_workers = _int_list(args.probe_workers, "--probe-workers") if args.probe_workers else None
    device, price, nodes = _device(args)
    price = _price(args, price)
    if device is None:
        for given, option in ((args.workers, "--workers"), (args.records, "--records"), (args.price, "--price")):
            if given is not None:
                raise UserError(f"{option} ranks the points on a device this plan does not run on.\n  fix: add "
                                "--cluster FILE or --device NAME, or leave it out to probe this cluster")
        result = make_plan(spec, address=args.address, device_memory=device_memory, probe_workers=probe_workers)
    else:
        if probe_workers is not None:
            raise UserError("--probe-workers probes this cluster, and --cluster / --device rank a device that is not "
                            "probed.\n  fix: drop one of them")
        device.peak(spec.train.precision)  # a precision the device lacks is refused before anything runs
        workers = worker_counts(args.workers) if args.workers else None
        result = cluster_plan(spec, device, nodes, price, workers, args.records, args.address)
    if getattr(args, "json", False):
        return 0, {"experiment": spec.name, "target": str(spec.target), "plan": str(result.path),
                   "seconds": result.seconds, "notes": result.notes, "rows": result.rows,
                   "device": None if device is None else dataclasses.asdict(device), "usd_per_gpu_hour": price}
    print("")
    if device is not None:
        print(f"device {device.describe()}" + (f"; ${price:.2f} per GPU-hour" if price is not None else ""))
    print(plan_table(result.rows))
    for r in result.rows:
        if not r.get("possible", True):
            print(f"{r['trial']}: {r['note']}")
    ranked = [r for r in result.rows if r.get("possible", True)]
    if not ranked:
        print(f"no point of the sweep is possible; plan in {result.path}")
        return 0
    best = ranked[0]
    print("+ step time from the step-time model on the device, nothing probed" if device is not None else
          "* step time from the model fitted to the probes, + from the step-time model calibrated on them; "
          "others probed")
    soonest = estimate.duration_text(best["predicted_time_to_target_s"])
    print(f"predicted fastest to {spec.target}: {best['trial']} ({soonest} of training); plan in {result.path} "
          f"({result.seconds:.0f} s)")
    priced = [r for r in ranked if r.get("predicted_cost_usd") is not None and r["fits"] is not False]
    if priced:
        cheapest = min(priced, key=lambda r: r["predicted_cost_usd"])
        cost, seconds = cheapest["predicted_cost_usd"], cheapest["predicted_time_to_target_s"]
        print(f"predicted cheapest to {spec.target}: {cheapest['trial']} ({estimate.usd_text(cost)}, "
              f"{estimate.duration_text(seconds)} on {cheapest['num_workers']} GPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
