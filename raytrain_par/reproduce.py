"""`raytrain-par reproduce [FINDING ...] [--paper]`: the findings of "A Survey and Empirical Evaluation
of Parallel Deep Learning Frameworks" (Nichols, Singh, Lin, Bhatele 2021), one command each.

A finding is an experiment of experiments/ (CPU-sized; experiments/paper/ with --paper) with a few
overrides that narrow its sweep to what the finding compares and keep it short, run through the same
`run_sweep` as `raytrain-par sweep`; then a judge reads the records and says whether the study's claim
held here, with the numbers. Each finding writes <out>/<finding>/index.md (the claim, a table, the
verdict, how it was produced) and its figure(s).

Everything that can be refused is refused before anything starts: an unknown finding, an experiment
or override that does not validate, and (with --paper, or --address) a cluster whose nodes cannot
hold the largest trial.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import shlex
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

from .config import ExperimentSpec, load_experiment
from .errors import UserError, say
from .provenance import commit as provenance_commit, provenance, write_page
from .tables import markdown_table
from .sweep import describe, plan

# The experiments are package data (a checkout's experiments/ links here): found installed or not.
EXPERIMENTS = Path(str(resources.files(__package__) / "experiments"))
# Where the pages go without --out: a checkout's docs/results where the current directory holds one
# (the published pages), else a directory of their own under the current directory.
DEFAULT_OUT = "docs/results"
ELSEWHERE_OUT = "reproduce"
RESULTS = "results/reproduce"  # records of every finding's sweep, under <RESULTS>/<finding>/
# Model states per worker, relative to data parallel's, that the study measured for ZeRO (the cut).
STUDY_ZERO_CUT = (0.42, 0.66)
# Largest relative difference between two validation losses that still counts as the same curve: fp32
# sums reduced in another order (buckets, reduce-scatter, sharded optimizer steps) differ in the 6th-7th
# significant digit; 1e-4 is a hundred times that and far below what one evaluation interval moves the
# loss by (the page states both).
IDENTICAL_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Setting:
    experiment: str                 # under experiments/
    overrides: tuple[str, ...]      # --set style, applied before the user's own


@dataclass
class Verdict:
    outcome: str                    # held | not held | partly
    summary: str                    # one or two sentences, with the numbers
    table: str                      # Markdown
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Finding:
    name: str
    title: str
    claim: str                      # as the study states it
    runs: str                       # what it runs, in words (for --list)
    cpu: Setting
    paper: Setting
    judge: Callable[[list[dict], list[dict]], Verdict]
    report_figures: tuple[str, ...] = ()   # of `raytrain-par report`'s figures, those the page shows
    bars: str | None = None                # a bar chart of memory per worker, drawn here


def sweep_override(**sweep) -> str:
    return "sweep=" + json.dumps({"max_concurrent_trials": 1, **sweep})


DATA_PARALLEL = [{"name": s} for s in ("ddp", "zero-1", "zero-2", "zero-3", "fsdp")]


# -- judges: (records, trial rows) -> verdict --------------------------------------------------------

def _curves(records: list[dict], key: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for r in records:
        if r.get(key) is not None:
            out[r["trial"]][r["step"]] = r[key]
    return out


def _largest(records: list[dict], trial: str, key: str) -> float | None:
    values = [r[key] for r in records if r["trial"] == trial and r.get(key) is not None]
    return max(values) if values else None


def _f(v, fmt: str = ".3f") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _mib(v) -> str:
    return _f(None if v is None else v / 2**20, ".1f")


def _strategy_label(t: dict) -> str:
    over = json.loads(t.get("overrides") or "{}")
    s = over.get("strategy")
    if isinstance(s, dict):
        extra = [f"{k} {v}" for k, v in s.items() if k != "name"]
        return s["name"] + (f" ({', '.join(extra)})" if extra else "")
    return t["strategy"]


def judge_identical(records: list[dict], trials: list[dict]) -> Verdict:
    curves = _curves(records, "val_loss")
    ref = next((t for t in trials if t["strategy"] == "ddp"), trials[0])
    base = curves[ref["trial"]]
    rows, worst = [], 0.0
    for t in trials:
        c = curves[t["trial"]]
        common = sorted(set(c) & set(base))
        diff = max((abs(c[s] - base[s]) / abs(base[s]) for s in common), default=math.nan)
        if t is not ref:
            worst = max(worst, diff if common and len(common) == len(base) else math.inf)
        rows.append([_strategy_label(t), t["num_workers"], len(c), _f(c[max(c)], ".6f") if c else "–",
                     "reference" if t is ref else _f(diff, ".1e"), _f(t.get("mean_step_time_s")),
                     _mib(_largest(records, t["trial"], "mem_model_state_census_bytes"))])
    steps = sorted(base)
    moved = abs(base[steps[0]] - base[steps[-1]]) / abs(base[steps[0]]) if len(steps) > 1 else 0.0
    table = markdown_table(["strategy", "workers", "evaluations", f"val loss at step {steps[-1]}",
                            "largest relative difference from ddp", "s/step", "model states MiB/worker (census)"],
                           rows)
    others = len(trials) - 1
    if worst == 0:
        outcome = "held"
        summary = (f"The validation losses of the {others} other strategies are bit-identical to ddp's at every "
                   f"evaluation (tolerance {IDENTICAL_TOLERANCE:.0e}); over the run the loss moved by {moved:.1%} of "
                   "its first value")
    elif worst <= IDENTICAL_TOLERANCE:
        outcome = "held"
        summary = (f"Every evaluation of the {others} other strategies is within {_f(worst, '.1e')} (relative) of "
                   f"ddp's validation loss, against a tolerance of {IDENTICAL_TOLERANCE:.0e}; over the run the loss "
                   f"moved by {moved:.1%} of its first value")
    else:
        outcome = "not held"
        summary = (f"The largest relative difference from ddp's validation loss is {_f(worst, '.1e')}, above the "
                   f"tolerance of {IDENTICAL_TOLERANCE:.0e}")
    notes = [f"Tolerance {IDENTICAL_TOLERANCE:.0e}: the strategies sum the same fp32 gradients in different orders "
             "(DDP buckets, ZeRO's partitioned reduce, FSDP's reduce-scatter), which moves a loss in its 6th-7th "
             f"significant digit; one evaluation interval moved ddp's loss by {moved / max(1, len(steps) - 1):.1%} "
             "here on average, so 1e-4 separates rounding from a different trajectory by orders of magnitude."]
    return Verdict(outcome, summary, table, notes)


def _falls(values: list[float | None]) -> list[bool]:
    """For each pair of neighbours that are both known: did the value fall?"""
    return [b < a for a, b in zip(values, values[1:]) if a is not None and b is not None]


def judge_scaling(records: list[dict], trials: list[dict]) -> Verdict:
    by_strategy: dict[str, list[dict]] = defaultdict(list)
    for t in trials:
        by_strategy[t["strategy"]].append(t)
    rows, checks, parts, unknown, workers = [], [], [], 0, ""
    for name, ts in by_strategy.items():
        ts = sorted(ts, key=lambda t: t["num_workers"])
        for t in ts:
            rows.append([name, t["num_workers"], t["global_batch_size"], t["steps"], _f(t.get("mean_step_time_s")),
                         _f(t.get("throughput"), ".1f"), _f(t.get("epoch_time_s"), ".0f"),
                         _f(t.get("time_to_target_s"), ".1f")])
        epoch = [t.get("epoch_time_s") for t in ts]
        target = [t.get("time_to_target_s") for t in ts]
        checks += _falls(epoch) + _falls(target)
        unknown += target.count(None) + epoch.count(None)
        parts.append(f"{name} {' → '.join(_f(v, '.0f') for v in epoch)} s per epoch and "
                     f"{' → '.join('not reached' if v is None else f'{v:.1f} s' for v in target)} to target")
        workers = " → ".join(str(t["num_workers"]) for t in ts)
    outcome = ("held" if checks and all(checks) and not unknown else "partly" if any(checks) else "not held")
    table = markdown_table(["strategy", "workers", "global batch", "steps", "s/step", "samples/s",
                            "time per epoch (s)", "time to target (s)"], rows)
    cores = os.cpu_count()
    notes = [f"This machine has {cores} CPU cores shared by every worker (and by Ray, Ray Data and the driver): "
             f"from {cores} workers on, each added worker takes compute from the others instead of adding its own, "
             "so time falls with workers only while there are idle cores, and communication (gloo over shared "
             "memory) competes with computation for the same cores. On GPUs each worker brings its own device.",
             "Every trial sees the same number of samples (the per-worker batch is fixed, as in the study; the "
             "learning rate follows the global batch by the square-root rule), evaluated at the same sample "
             "counts; \"–\" means the target was not reached in that budget."]
    fell = sum(checks)
    summary = (f"Time fell in {fell} of {len(checks)} comparisons from one worker count to the next (time per "
               f"epoch and time to target, where reached): for {workers} workers, {'; '.join(parts)}")
    return Verdict(outcome, summary, table, notes)


def judge_staleness(records: list[dict], trials: list[dict]) -> Verdict:
    curves = _curves(records, "val_loss")
    sync = [t for t in trials if t["strategy"] != "pipedream"]
    stale = [t for t in trials if t["strategy"] == "pipedream"]
    if not sync or not stale:
        raise UserError("staleness: the sweep needs a synchronous pipeline and pipedream trial; fix: keep both in "
                        "sweep.grid.strategy")
    steps = sorted(set.intersection(*(set(curves[t["trial"]]) for t in trials)) - {0})
    head = ["strategy", "s/step", "time to target (s)", *[f"val loss, step {s}" for s in steps]]
    rows = [[_strategy_label(t), _f(t.get("mean_step_time_s")), _f(t.get("time_to_target_s"), ".1f"),
             *[_f(curves[t["trial"]][s], ".3f") for s in steps]] for t in trials]
    best_sync = {s: min(curves[t["trial"]][s] for t in sync) for s in steps}
    gaps = {s: min(curves[t["trial"]][s] for t in stale) - best_sync[s] for s in steps}
    behind = [s for s in steps if gaps[s] > 0]
    outcome = "held" if steps and len(behind) == len(steps) else "partly" if behind else "not held"
    last = steps[-1] if steps else None
    summary = (f"PipeDream's validation loss is above the synchronous pipeline's at {len(behind)} of {len(steps)} "
               f"evaluations at equal steps" + (f", by {gaps[last]:+.3f} at step {last}" if last else ""))
    ttt = {_strategy_label(t): t.get("time_to_target_s") for t in trials}
    summary += "; time to target " + ", ".join(f"{k} " + (f"{v:.1f} s" if v is not None else "not reached")
                                               for k, v in ttt.items())
    notes = ["PipeDream's first stage computes its forward pass with weights one update older than the ones its "
             "gradient is applied to (weight stashing keeps each micro-batch's forward and backward consistent, "
             "not current); the synchronous schedules apply the exact gradient of the current weights, so GPipe "
             "and 1F1B train the same numbers."]
    return Verdict(outcome, summary, markdown_table(head, rows), notes)


def _memory_rows(records: list[dict], trials: list[dict]):
    """(trial, census, theory, allocator, peak) per trial, memory per worker (the largest)."""
    for t in trials:
        yield (t, *(_largest(records, t["trial"], k) for k in (
            "mem_model_state_census_bytes", "mem_model_state_theory_bytes", "mem_model_state_bytes",
            "mem_peak_bytes")))


def judge_zero_memory(records: list[dict], trials: list[dict]) -> Verdict:
    """The study's claim has three parts: model states (what ZeRO partitions), the memory of the whole
    worker, and speed. Held when all three hold at the largest worker count, partly when some do."""
    by_workers: dict[int, dict[str, tuple]] = defaultdict(dict)
    for t, census, theory, alloc, peak in _memory_rows(records, trials):
        by_workers[t["num_workers"]][t["strategy"]] = (t, census, theory, alloc, peak)
    rows, best = [], {}  # best: workers -> (model-state cut, peak cut, step-time ratio, stage) of the best ZeRO stage
    for n in sorted(by_workers):
        ddp = by_workers[n].get("ddp")
        for name, (t, census, theory, alloc, peak) in sorted(by_workers[n].items()):
            def cut(i, v):
                return None if not ddp or not ddp[i] or v is None else 1 - v / ddp[i]
            rows.append([name, n, _mib(census), _f(cut(1, census), ".0%"), _mib(theory), _f(cut(2, theory), ".0%"),
                         _mib(alloc), _mib(peak), _f(cut(4, peak), ".0%"), _f(t.get("mean_step_time_s"))])
            if name.startswith("zero-") and cut(1, census) is not None and cut(1, census) > best.get(n, (-1,))[0]:
                speed = (t.get("mean_step_time_s") or math.nan) / (ddp[0].get("mean_step_time_s") or math.nan)
                best[n] = (cut(1, census), cut(4, peak), speed, name)
    table = markdown_table(["strategy", "workers", "model states MiB/worker (census)", "cut vs ddp", "theory MiB",
                            "theory cut", "allocator's model states MiB", "peak MiB/worker", "peak cut", "s/step"],
                           rows)
    if not best:
        return Verdict("not held", "no ZeRO trial with a data-parallel trial of the same worker count to compare",
                       table)
    lo, hi = STUDY_ZERO_CUT
    n = max(best)
    states, peak, speed, stage = best[n]
    parts = [states >= lo, peak is not None and peak >= lo, speed <= 1.1]
    outcome = "held" if all(parts) else "partly" if any(parts) else "not held"
    where = "within" if lo <= states <= hi else "beyond" if states > hi else "below"
    summary = (f"The study measured {lo:.0%}–{hi:.0%} less memory per GPU with ZeRO at no cost in speed. Model "
               "states: the best ZeRO stage held " + ", ".join(
                   f"{best[w][0]:.0%} less per worker than ddp on {w} workers ({best[w][3]})" for w in sorted(best))
               + f", {where} the study's range. The whole worker: its peak memory changed by {-peak:+.0%} on {n} "
               f"workers ({stage}). Speed: {stage} took {speed:.2f}x ddp's time per step")
    notes = ["The census counts the storages of live parameters, gradients and optimizer state once each: the "
             "model states ZeRO partitions. The allocator's figure adds communication buckets and runtime buffers, "
             "and the peak the activations and the whole process (on CPU the Python, torch and Ray runtime, about "
             "a gigabyte per worker), which ZeRO does not partition: at this model size the peak barely moves, where "
             "on a GPU holding a large model the model states dominate it. On two shared cores the sharded stages' "
             "extra communication (gathering parameters, reduce-scattering gradients) costs time that GPUs with "
             "their own links hide.",
             "Theory (fp32 AdamW): ddp 16 bytes per parameter, ZeRO-1 4 + 4 + 8/N, ZeRO-2 4 + 12/N, ZeRO-3 and "
             "FSDP 16/N on N workers; the study's range came from mixed precision on up to 64 GPUs, where the "
             "cut grows with N. FSDP shards like ZeRO-3 and is shown beside it, not counted as a ZeRO stage."]
    return Verdict(outcome, summary, table, notes)


def _layout(t: dict) -> tuple[str, int, int]:
    """(strategy, tensor-parallel degree, data-parallel degree) of a trial."""
    over = json.loads(t.get("overrides") or "{}")
    s = over.get("strategy") or {}
    tp = int(s.get("tensor_parallel", 1)) if t["strategy"] == "megatron" else 1
    return t["strategy"], tp, t["num_workers"] // tp


def judge_megatron(records: list[dict], trials: list[dict]) -> Verdict:
    rows, tp_only, mixed, ddp = [], {}, {}, {}
    trials = sorted(trials, key=lambda t: (t["strategy"] != "megatron", _layout(t)[2], _layout(t)[1]))
    for t, census, theory, alloc, peak in _memory_rows(records, trials):
        name, tp, dp = _layout(t)
        label = f"megatron T={tp}" + (f" × D={dp}" if dp > 1 else "") if name == "megatron" else f"{name} × {dp}"
        rows.append([label, t["num_workers"], _mib(census), _mib(theory), _mib(peak), _f(t.get("mean_step_time_s"))])
        if name == "megatron" and dp == 1:
            tp_only[tp] = (census, peak)
        elif name == "megatron":
            mixed[t["num_workers"]] = (census, peak, t.get("mean_step_time_s"), label)
        else:
            ddp[t["num_workers"]] = (census, peak, t.get("mean_step_time_s"))
    table = markdown_table(["layout", "workers", "model states MiB/worker (census)", "theory MiB", "peak MiB/worker",
                            "s/step"], rows)
    degrees = sorted(tp_only)
    peaks = [tp_only[d][1] for d in degrees]
    text = "Peak memory per worker against T: " + ", ".join(f"T={d} {_mib(p)} MiB" for d, p in zip(degrees, peaks))
    if len(degrees) >= 3 and None not in peaks:
        low = peaks.index(min(peaks))
        u = 0 < low < len(peaks) - 1
        outcome = "held" if u else "not held"
        text += f" ({'a U: lowest at T=' + str(degrees[low]) if u else 'no U: the lowest is at an end'})"
    else:
        fell = len(peaks) == 2 and None not in peaks and peaks[1] < peaks[0]
        outcome = "partly" if fell else "not held"
        text += (" (the falling side of the U only: its rise needs T ≥ 4, with --paper)" if fell else "")
    for n, (census, peak, step, label) in sorted(mixed.items()):
        if n in ddp:
            d = ddp[n]
            text += (f"; {label} holds {_mib(census)} MiB of model states per worker against ddp's {_mib(d[0])} on "
                     f"{n} workers (peak {_mib(peak)} against {_mib(d[1])}), at {_f(step)} against {_f(d[2])} s/step")
    notes = ["Tensor parallel splits every layer's weights T ways, so model states fall as 1/T, but the layer norms' "
             "inputs and outputs and the position embedding stay whole on every worker, and each layer adds "
             "all-reduce buffers of the activations: with T large the split part is small and the whole part and "
             "the buffers dominate, which is the rise of the study's U. On this 2-core machine only T = 1, 2 fit.",
             "The study found Megatron within a node combined with data parallel across nodes fastest for large "
             "models on many GPUs; on CPU the step times here say nothing about that (gloo all-reduces of "
             "activations on shared cores), only the memory per worker does."]
    return Verdict(outcome, text, table, notes)


FINDINGS: dict[str, Finding] = {f.name: f for f in [
    Finding(
        "identical-curves", "data parallel and ZeRO train identical curves",
        "Data parallel (DDP) and ZeRO keep the best statistical efficiency: with the same global batch they train "
        "identical curves, the same validation loss at every evaluation.",
        "ddp, zero-1/2/3 and fsdp on the same GPT-2 tiny, 2 workers, 30 steps (experiments/strategies.yaml)",
        Setting("strategies.yaml", ("train.max_steps=30", "train.eval_every_steps=10",
                                    sweep_override(grid={"strategy": DATA_PARALLEL}))),
        Setting("paper/strategies-gpt2-medium.yaml", (sweep_override(grid={"strategy": DATA_PARALLEL}),)),
        judge_identical, report_figures=("convergence_epochs.png",)),
    Finding(
        "scaling", "time falls with the number of workers",
        "With data parallelism (DDP and ZeRO), time per epoch and time to a target quality fall as workers are "
        "added (each worker with its own batch: the global batch grows with the worker count).",
        "ddp and zero-2 on 1, 2 and 4 workers, 16 rows per worker, the same samples for each "
        "(experiments/sweep-workers-batch.yaml)",
        Setting("sweep-workers-batch.yaml", (
            "target=val_perplexity <= 300",
            sweep_override(grid={"strategy.name": ["ddp", "zero-2"]}, lr_scaling="sqrt", cases=[
                {"scaling.num_workers": n, "train.global_batch_size": 16 * n, "train.max_steps": 128 // n,
                 "train.eval_every_steps": 32 // n, "train.warmup_steps": max(1, 16 // n)} for n in (1, 2, 4)]))),
        Setting("paper/gpt2-medium-wikitext.yaml", (
            "train.optimizer=adamw", "train.lr=3.0e-4",   # ZeRO splits tensors, which LAMB needs whole
            sweep_override(grid={"strategy.name": ["ddp", "zero-2"]}, cases=[
                {"scaling.num_workers": n, "train.global_batch_size": 32 * n} for n in (1, 2, 4, 8, 16, 32, 64)]))),
        judge_scaling, report_figures=("epoch_time.png", "convergence_wall_time.png")),
    Finding(
        "staleness", "PipeDream's weight staleness slows convergence",
        "PipeDream's asynchronous pipeline updates weights with gradients computed on stale weights, and converges "
        "more slowly per step than a synchronous pipeline (GPipe) on the same model and batch.",
        "GPipe, 1F1B and PipeDream, 2 stages on 2 workers, 90 steps (experiments/pipeline-staleness.yaml)",
        Setting("pipeline-staleness.yaml", ("train.max_steps=90", "train.eval_every_steps=15",
                                            "target=val_perplexity <= 300",
                                            sweep_override(grid={"strategy": [
                                                {"name": "pipeline", "stages": 2, "schedule": "gpipe"},
                                                {"name": "pipeline", "stages": 2, "schedule": "1f1b"},
                                                {"name": "pipedream", "stages": 2}]}))),
        Setting("paper/gpt2-medium-pipeline.yaml", ("sweep.max_concurrent_trials=1",)),
        judge_staleness, report_figures=("convergence_epochs.png", "convergence_wall_time.png")),
    Finding(
        "zero-memory", "ZeRO cuts memory per GPU by 42–66% against data parallel",
        "ZeRO reduces the memory each GPU holds by 42–66% against data parallel, at no cost in speed.",
        "ddp, zero-1/2/3 and fsdp on 2 and 4 workers, a 26M-parameter GPT-2, fp32, 4 steps "
        "(experiments/zero-memory.yaml)",
        Setting("zero-memory.yaml", ("train.max_steps=4", "train.eval_every_steps=2",
                                     sweep_override(grid={"strategy.name": ["ddp", "zero-1", "zero-2", "zero-3", "fsdp"],
                                                          "scaling.num_workers": [2, 4]}))),
        Setting("paper/zero-memory.yaml", ()),
        judge_zero_memory, report_figures=(), bars="zero"),
    Finding(
        "megatron-memory", "Megatron's memory against tensor-parallel degree is U-shaped",
        "Megatron's memory per GPU against the tensor-parallel degree is U-shaped (it falls, then rises as the "
        "unsplit parts and communication buffers dominate), and Megatron within a node combined with data parallel "
        "is the best choice for large models on many GPUs.",
        "megatron T=1 (1 worker), T=2 (2 workers), T=2 × D=2 (4 workers) against ddp on 2 and 4 workers, "
        "6 steps (experiments/megatron.yaml)",
        Setting("megatron.yaml", ("train.max_steps=6", "train.eval_every_steps=3", sweep_override(cases=[
            {"strategy": {"name": "megatron", "tensor_parallel": t}, "scaling.num_workers": n}
            for t, n in ((1, 1), (2, 2), (2, 4))] + [
            {"strategy": {"name": "ddp"}, "scaling.num_workers": n} for n in (2, 4)]))),
        Setting("paper/megatron-gpt2-medium.yaml", ("train.max_steps=100", "train.eval_every_steps=50",
                                                    "train.checkpoint_every_evals=0", sweep_override(cases=[
            {"strategy": {"name": "megatron", "tensor_parallel": t}, "scaling.num_workers": n}
            for t, n in ((1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (4, 16))] + [
            {"strategy": {"name": "ddp"}, "scaling.num_workers": 16}]))),
        judge_megatron, report_figures=(), bars="megatron"),
]}


# -- planning: what a finding runs, validated before anything starts ---------------------------------

@dataclass
class Planned:
    finding: Finding
    paper: bool
    experiment: Path
    overrides: list[str]            # the finding's, then the user's
    spec: ExperimentSpec
    trials: list[tuple[str, ExperimentSpec]]   # (name, experiment) of every trial

    @property
    def command(self) -> str:
        user = self.overrides[len(self.setting.overrides) + 2:]
        return " ".join(["raytrain-par reproduce", self.finding.name, *(["--paper"] if self.paper else []),
                         *(f"--set {shlex.quote(o)}" for o in user)])

    @property
    def setting(self) -> Setting:
        return self.finding.paper if self.paper else self.finding.cpu


def find(names: list[str]) -> list[Finding]:
    """The findings named (all of them for none), or an error naming the known ones."""
    for n in names:
        if n not in FINDINGS:
            close = difflib.get_close_matches(n, list(FINDINGS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"reproduce: unknown finding {n!r}{hint}.\n  fix: use some of: {', '.join(FINDINGS)} "
                            "(`raytrain-par reproduce --list` says what each runs)")
    return [FINDINGS[n] for n in dict.fromkeys(names)] if names else list(FINDINGS.values())


def plan_finding(finding: Finding, paper: bool = False, overrides: list[str] | None = None) -> Planned:
    setting = finding.paper if paper else finding.cpu
    path = EXPERIMENTS / setting.experiment
    if not path.is_file():
        raise UserError(f"reproduce {finding.name}: {path} is missing from the installed package.\n  fix: reinstall "
                        "raytrain-par (pip install --force-reinstall raytrain-par, or pip install -e . in a checkout)")
    every = [*setting.overrides, f"name={finding.name}", f"output_dir={RESULTS}", *(overrides or [])]
    # Paper-sized data lives on the cluster (data.path): it is checked there, not here.
    spec = load_experiment(path, every, check_data=not paper)
    p = plan(spec)
    return Planned(finding, paper, path, every, spec, [(describe(pt), p.trial_spec(pt)) for pt in p.points])


def check_cluster(planned: list[Planned], address: str | None) -> None:
    """Can the cluster hold the largest trial of every finding? The machine itself without an address;
    a running cluster's nodes with one (an autoscaling cluster's nodes must be up: check its cluster
    file offline with `raytrain-par cluster validate FILE --experiment X.yaml` instead)."""
    from .clusters import ClusterFile, NodeType, check_capacity

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        import ray

        from .driver import check_reachable, worker_env

        check_reachable(address)
        ray.init(address=address, runtime_env={"env_vars": worker_env()}, logging_level="ERROR")
        try:
            alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        finally:
            ray.shutdown()
        where = f"the cluster at {address}"
    else:
        import torch

        alive = [{"CPU": os.cpu_count() or 1, "GPU": torch.cuda.device_count()}]
        where = "this machine"  # no --address or RAY_ADDRESS given
    kinds: dict[tuple, int] = defaultdict(int)
    for r in alive:
        kinds[(r.get("CPU", 0), r.get("GPU", 0))] += 1
    # check_capacity names the cluster by its path: here the words (a Path would fold the // of ray://)
    cluster = ClusterFile(where, kind="running", max_workers=len(alive), node_types=[
        NodeType(f"{n} node(s) of {c:g} CPUs, {g:g} GPUs", {"CPU": c, "GPU": g}, n, n) for (c, g), n in kinds.items()])
    have = "; ".join(t.name for t in cluster.node_types)
    for pl in planned:
        if not pl.paper and not address:
            continue  # CPU-sized runs size their own embedded cluster
        check_capacity(cluster, pl.spec, pl.finding.name)
        if cluster.problems:
            e = cluster.problems[0]
            raise UserError(f"reproduce {pl.finding.name}{' --paper' if pl.paper else ''}: {_needs(pl)}; {where} "
                            f"has {have} ({e.field} = {e.value!r}: {e.problem}).\n  fix: join a cluster that holds it "
                            "(--address, or RAY_ADDRESS), or leave --paper out to run the CPU-sized finding")


def _needs(pl: Planned) -> str:
    """What the largest trial of a finding asks of the cluster, in words."""
    s = max((s for _, s in pl.trials), key=lambda s: s.scaling.num_workers).scaling
    each = f"{s.cpus_per_worker:g} CPUs" + (f" and {s.gpus_per_worker:g} GPU" if s.use_gpu else "")
    total = f" ({s.num_workers * s.gpus_per_worker:g} GPUs)" if s.use_gpu else ""
    return f"its largest trial needs {s.num_workers} workers of {each} each{total}"


# -- running and writing -------------------------------------------------------------------------------

def _bar_chart(records: list[dict], trials: list[dict], kind: str, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, census, theory, peak = [], [], [], []
    trials = sorted(trials, key=lambda t: (t["strategy"], _layout(t)[2], _layout(t)[1], t["num_workers"]))
    for t, c, th, _, p in _memory_rows(records, trials):
        name, tp, dp = _layout(t)
        labels.append(f"{name} T={tp}" + (f"×D={dp}" if dp > 1 else "") if name == "megatron"
                      else f"{name}\n{t['num_workers']} workers")
        census.append((c or 0) / 2**20)
        theory.append((th or 0) / 2**20)
        peak.append((p or 0) / 2**20)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 4.5))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], census, width=0.4, label="model states (census)")
    ax.bar([x + 0.2 for x in xs], theory, width=0.4, label="model states (theory)", alpha=0.6)
    if kind == "megatron":
        ax2 = ax.twinx()
        ax2.plot(list(xs), peak, "ko", markersize=7, label="peak per worker")  # points: layouts are not a series
        ax2.set_ylabel("peak memory per worker (MiB)")
        ax2.legend(loc="upper right", fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=7, rotation=30 if kind == "megatron" else 0)
    ax.set_ylabel("MiB per worker")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_finding(pl: Planned, records: list[dict], trials: list[dict], out: Path,
                  minutes: float, made: dict | None = None) -> tuple[Path, Verdict]:
    """<out>/<finding>/index.md and its figures (`raytrain-par report`'s, from the sweep's directory)."""
    f = pl.finding
    page_dir = out / f.name
    if page_dir.exists():
        shutil.rmtree(page_dir)
    page_dir.mkdir(parents=True)
    verdict = f.judge(records, trials)
    figures = []
    if f.report_figures:
        for name in f.report_figures:
            shutil.copy(pl.spec.results_dir / name, page_dir / name)
            figures.append(name)
    if f.bars:
        _bar_chart(records, trials, f.bars, f"{f.name}: memory per worker", page_dir / "memory.png")
        figures.append("memory.png")
    failed = [t["trial"] for t in trials if t.get("status") == "failed"]
    overrides = "\n".join(f"    --set {shlex.quote(o)}" for o in pl.setting.overrides)
    body = [f"**{verdict.outcome.capitalize()}.** {verdict.summary}.", "## The study's finding", f.claim,
            "## What was measured here", verdict.table, *verdict.notes]
    if failed:
        body.append(f"Trials that failed (their records are missing above): {', '.join(failed)}.")
    body += [*(f"![{Path(n).stem}]({n})" for n in figures),
             "## How it ran",
             f"`{shown(pl.experiment)}` with these overrides (then `name`, `output_dir`"
             f"{' and the command line' if len(pl.overrides) > len(pl.setting.overrides) + 2 else ''}), one trial "
             f"at a time through `raytrain-par sweep`'s Ray Tune path: {len(trials)} trials in {minutes:.1f} minutes "
             f"of wall-clock time, records in `{_shown(pl.spec.results_dir)}`.",
             f"```\n{overrides}\n```" if overrides else ""]
    page = write_page(page_dir / "index.md", f"Reproduced: {f.title}", "\n\n".join(b for b in body if b),
                      command=pl.command, made=made)
    return page, verdict


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when below it."""
    path = path.resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def run_finding(pl: Planned, out: Path, address: str | None = None, log=say,
                commit: str | None = None) -> tuple[Path, Verdict, float]:
    """`commit`: the one `reproduce` started from (by default the checkout's now), so that the pages the
    findings before this one wrote do not count as changes to the commit this one names."""
    from .metrics.records import read_records
    from .report import write_report
    from .tuning import run_sweep

    t0, made = time.perf_counter(), provenance(pl.command)
    made["commit"] = commit or made["commit"]
    result = run_sweep(pl.spec, address=address, log=log)
    if not result.records:
        raise UserError(f"reproduce {pl.finding.name}: no trial wrote a record (see the errors above)")
    trials = read_records(result.results_dir / "trials.parquet")
    if pl.finding.report_figures:
        write_report(result.results_dir)
    minutes = (time.perf_counter() - t0) / 60
    page, verdict = write_finding(pl, result.records, trials, out, minutes, made)
    return page, verdict, minutes


_RUN = re.compile(r"Written by `[^`]*` on (?P<date>\S+) [^,]*, commit `(?P<commit>[^`]+)`, on (?P<machine>[^(,]+?) \(")
_TOOK = re.compile(r"(?P<trials>\d+) trials in (?P<minutes>[\d.]+) minutes of wall-clock time")


def shown(experiment: Path) -> str:
    """An experiment's name as a user finds it: experiments/..., in a checkout and in the package."""
    return f"experiments/{experiment.relative_to(EXPERIMENTS).as_posix()}"


def default_out(paper: bool) -> Path:
    base = Path(DEFAULT_OUT) if Path(DEFAULT_OUT).is_dir() else Path(ELSEWHERE_OUT)
    return base / "paper" if paper else base


def last_run(name: str, out: Path) -> str:
    """How long the finding took when its page in `out` was written, read off that page (the run
    wrote both figures): 'N min (machine, date, commit)', or that it has not run there."""
    page = out / name / "index.md"
    text = page.read_text(encoding="utf-8") if page.exists() else ""
    run, took = _RUN.search(text), _TOOK.search(text)
    if not (run and took):
        return "not run yet"
    return f"{float(took['minutes']):.0f} min ({run['machine']}, {run['date']}, commit {run['commit']})"


def list_text(out: Path) -> str:
    rows = [[f.name, f.runs, last_run(f.name, out), f"experiments/{f.paper.experiment}"] for f in FINDINGS.values()]
    head = ["finding", "runs (CPU-sized)", f"took ({out}/)", "--paper"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *rows])


def main(args, log=say) -> int:
    out = Path(args.out) if args.out else default_out(args.paper)
    if args.list:
        log(list_text(out))
        return 0
    findings = find(args.findings)
    planned = [plan_finding(f, args.paper, args.overrides) for f in findings]
    if args.paper or args.address:
        check_cluster(planned, args.address)
    started_from = provenance_commit()  # before any finding writes its page
    outcomes = []
    for pl in planned:
        log(f"reproduce {pl.finding.name}: {len(pl.trials)} trial(s) of {shown(pl.experiment)}")
        page, verdict, minutes = run_finding(pl, out, args.address, log=log, commit=started_from)
        outcomes.append((pl.finding.name, verdict.outcome, minutes, page))
    log("")
    for name, outcome, minutes, page in outcomes:
        log(f"{name}: {outcome} ({minutes:.1f} min) -> {page}")
    return 0
