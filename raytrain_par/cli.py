"""raytrain-par: compare ways of parallelising training on a Ray cluster.

    raytrain-par run EXPERIMENT.yaml [--address ADDR] [--set key=value ...] [--resume]
    raytrain-par sweep EXPERIMENT.yaml [--address ADDR] [--set ...] [--resume]   Ray Tune over its sweep block
    raytrain-par plan EXPERIMENT.yaml [--set ...] [--device-memory 80GiB]   predicted time-to-target of every sweep point
    raytrain-par report RESULTS_DIR [--out DIR]         figures and a ranked summary of a run or sweep
    raytrain-par check EXPERIMENT.yaml [--set ...]      validate and print the resolved experiment
    raytrain-par data EXPERIMENT.yaml                   prepare (and cache) the experiment's data set
    raytrain-par cluster validate [FILES] [--experiment X.yaml ...]   check cluster YAMLs offline
    raytrain-par estimate EXPERIMENT.yaml [--workers 1,2,4,8] [--device-memory 80GiB] [--strategies ...]
                                                        per-worker memory of each strategy, before launching
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
    est.add_argument("--device", help="predict step times on this device: one of " + ", ".join(_device_names()))
    est.add_argument("--gpus-per-node", type=int, help="accelerators per node (default: the device's node)")
    est.add_argument("--set-device", dest="device_overrides", action="append", default=[], metavar="FIELD=VALUE",
                     help="override a figure of --device, e.g. inter_node_bw=12.5 (GB/s) or achievable=0.4")
    json_arg(est)

    exp = add("export", help="write the plain model of a run's latest checkpoint")
    exp.add_argument("run_dir", help="results directory of a run (results/<experiment>) or a checkpoint")
    exp.add_argument("--out", required=True, help="directory to write the model into")

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

        export(args.run_dir, args.out)
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
    """--device with --gpus-per-node and --set-device applied, or None."""
    from .devices import device

    overrides = {}
    for item in args.device_overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--set-device {item!r}: expected FIELD=VALUE.\n  fix: e.g. --set-device inter_node_bw=12.5")
        overrides[key.strip()] = value.strip()
    if args.device is None:
        if overrides or args.gpus_per_node is not None:
            raise UserError("--set-device and --gpus-per-node change a --device, and none is named.\n"
                            f"  fix: add --device, one of {', '.join(_device_names())}")
        return None
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise UserError(f"--gpus-per-node {args.gpus_per_node}: must be at least 1.\n  fix: e.g. --gpus-per-node 8")
    return device(args.device, overrides, args.gpus_per_node)


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
    device = _device(args)
    if device is not None:
        device.peak(spec.train.precision)  # a precision the device lacks is refused before anything is sized
    device_memory = estimate.parse_size(args.device_memory) if args.device_memory else None
    if device_memory is None and device is not None:
        device_memory = int(device.memory_bytes)
    rows = estimate.estimate(spec, names, workers, device)
    params = rows[0].params if rows else 0
    doc = {"experiment": spec.name, "model": spec.model.name, "parameters": params,
           "optimizer": spec.train.optimizer, "precision": spec.train.precision,
           "global_batch_size": spec.train.global_batch_size,
           "activation_checkpointing": spec.train.activation_checkpointing, "device_memory_bytes": device_memory,
           "device": None if device is None else dataclasses.asdict(device),
           "rows": [estimate.row_document(r, device_memory, device) for r in rows]}
    if getattr(args, "json", False):
        return 0, doc
    print(f"{spec.name}: {spec.model.name}, {params / 1e6:.1f}M parameters, {spec.train.optimizer}, "
          f"{spec.train.precision}, global batch {spec.train.global_batch_size}"
          + (f", activation checkpointing {spec.train.activation_checkpointing}"
             if spec.train.activation_checkpointing != "none" else "")
          + (f", device memory {args.device_memory}" if args.device_memory else ""))
    if device is not None:
        print(f"device {device.describe()}")
    print(estimate.table(rows, device_memory, device))
    if device is not None:
        print("step (s) = compute + comm (what no computation hides) + bubble; figures and their sources: "
              "raytrain-par estimate --json, under 'device'")
    return 0


def _plan(spec, args) -> int:
    from . import estimate
    from .goodput import make_plan, plan_table

    device_memory = estimate.parse_size(args.device_memory) if args.device_memory else None
    result = make_plan(spec, address=args.address, device_memory=device_memory)
    if getattr(args, "json", False):
        return 0, {"experiment": spec.name, "target": str(spec.target), "plan": str(result.path),
                   "seconds": result.seconds, "notes": result.notes, "rows": result.rows}
    print("")
    print(plan_table(result.rows))
    best = result.rows[0]
    print(f"* step time predicted by the fitted model, not probed at that point\n"
          f"predicted fastest to {spec.target}: {best['trial']} ({best['predicted_time_to_target_s']:.1f} s of "
          f"training); plan in {result.path} ({result.seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
