"""`raytrain-par reproduce`: the list, bad input refused before anything starts, what each finding
would run (planned, not run), and one finding end to end on the session's Ray cluster."""

import pytest

from raytrain_par import cli, reproduce
from raytrain_par.errors import UserError


def test_list_names_every_finding_with_what_it_runs(capsys):
    assert cli.main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    for name, f in reproduce.FINDINGS.items():
        line = next(line for line in out.splitlines() if line.startswith(name))
        assert f.cpu.experiment in line and f.paper.experiment in line
        assert reproduce.last_run(name, reproduce.default_out(paper=False)) in line
    assert "took (docs/results/)" in out


def test_list_reads_each_findings_time_off_its_page(tmp_path):
    """The time --list shows is the one the finding's page says it took, with where and when."""
    assert reproduce.last_run("staleness", tmp_path) == "not run yet"
    reproduce.write_page(tmp_path / "staleness" / "index.md", "Reproduced: x",
                         "**Held.** ...\n\none trial at a time: 3 trials in 6.34 minutes of wall-clock time, records in `r`.",
                         command="raytrain-par reproduce staleness",
                         made={**reproduce.provenance(), "date": "2026-11-30 23:06 UTC", "commit": "fd5b879"})
    took = reproduce.last_run("staleness", tmp_path)
    assert took.startswith("6 min (") and took.endswith(", 2026-11-30, commit fd5b879)"), took


def test_unknown_finding_names_the_known_ones(capsys):
    assert cli.main(["reproduce", "identical-curve", "zero-memory"]) == 2
    err = capsys.readouterr().err
    assert "unknown finding 'identical-curve'" in err and "did you mean 'identical-curves'?" in err
    assert all(name in err for name in reproduce.FINDINGS)


def test_paper_on_a_machine_without_gpus_says_what_it_needs(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli.main(["reproduce", "megatron-memory", "--paper"]) == 2
    err = capsys.readouterr().err
    assert "needs 16 workers of 8 CPUs and 1 GPU each (16 GPUs)" in err
    assert "this machine has 1 node(s) of" in err and "0 GPUs" in err and "no node type with GPUs" in err


def test_paper_against_a_cluster_too_small(monkeypatch):
    """A cluster with GPUs, but fewer than the largest trial's: the capacity check of clusters.py says so."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr("os.cpu_count", lambda: 96)
    planned = [reproduce.plan_finding(reproduce.FINDINGS["zero-memory"], paper=True)]
    with pytest.raises(UserError, match=r"needs 64 workers .* \(64 GPUs\); this machine has 1 node\(s\) of 96 CPUs, "
                                        r"8 GPUs \(scaling.num_workers = 64: this machine holds at most 8"):
        reproduce.check_cluster(planned, None)
    reproduce.check_cluster([reproduce.plan_finding(reproduce.FINDINGS["identical-curves"], paper=True)], None)


def _trials(name, paper=False, overrides=()):
    pl = reproduce.plan_finding(reproduce.FINDINGS[name], paper, list(overrides))
    return pl, [(s.strategy.name, s.strategy.to_dict(), s.scaling.num_workers, s.train.global_batch_size,
                 s.train.max_steps) for _, s in pl.trials]


def test_identical_curves_plans_every_data_parallel_strategy_on_one_batch():
    pl, trials = _trials("identical-curves")
    assert pl.experiment.name == "strategies.yaml" and pl.spec.name == "identical-curves"
    assert [t[0] for t in trials] == ["ddp", "zero-1", "zero-2", "zero-3", "fsdp"]
    assert {t[2:] for t in trials} == {(2, 32, 30)}
    assert pl.spec.sweep["max_concurrent_trials"] == 1 and pl.spec.output_dir == reproduce.RESULTS
    assert pl.command == "raytrain-par reproduce identical-curves"
    pl, trials = _trials("identical-curves", paper=True)
    assert pl.experiment.name == "strategies-gpt2-medium.yaml" and {t[2:4] for t in trials} == {(8, 256)}


def test_scaling_plans_the_same_samples_per_worker_count():
    pl, trials = _trials("scaling")
    assert pl.experiment.name == "sweep-workers-batch.yaml"
    assert sorted((t[0], t[2], t[3], t[4]) for t in trials) == [
        (s, n, 16 * n, 128 // n) for s in ("ddp", "zero-2") for n in (1, 2, 4)]
    lr = {(s.scaling.num_workers): s.train.lr for _, s in pl.trials}
    assert lr[4] == pytest.approx(2 * lr[1])  # square-root rule: batch x4, lr x2
    _, trials = _trials("scaling", paper=True)
    assert max(t[2] for t in trials) == 64 and {t[0] for t in trials} == {"ddp", "zero-2"}


def test_staleness_plans_synchronous_pipelines_against_pipedream():
    pl, trials = _trials("staleness")
    assert [(t[0], t[1].get("schedule")) for t in trials] == [("pipeline", "gpipe"), ("pipeline", "1f1b"),
                                                               ("pipedream", None)]
    assert {t[4] for t in trials} == {90} and pl.spec.target.value == 300


def test_memory_findings_plan_their_layouts():
    _, trials = _trials("zero-memory")
    assert sorted({(t[0], t[2]) for t in trials}) == sorted(
        (s, n) for s in ("ddp", "zero-1", "zero-2", "zero-3", "fsdp") for n in (2, 4))
    pl, _ = _trials("megatron-memory")
    layouts = [(s.strategy.name, getattr(s.strategy.options, "tensor_parallel", 1), s.scaling.num_workers)
               for _, s in pl.trials]
    assert layouts == [("megatron", 1, 1), ("megatron", 2, 2), ("megatron", 2, 4), ("ddp", 1, 2), ("ddp", 1, 4)]
    pl, _ = _trials("megatron-memory", paper=True)
    assert {getattr(s.strategy.options, "tensor_parallel", 1) for _, s in pl.trials} >= {1, 2, 4, 8}


def test_user_overrides_come_last_and_name_the_command():
    pl, trials = _trials("zero-memory", overrides=["train.max_steps=2"])
    assert {t[4] for t in trials} == {2}
    assert pl.command == "raytrain-par reproduce zero-memory --set train.max_steps=2"


def test_judges_read_records():
    """The verdicts from hand-made records: identical curves within the tolerance, and not."""
    def rec(trial, strategy, step, loss):
        return {"trial": trial, "strategy": strategy, "step": step, "val_loss": loss}
    trials = [{"trial": "a", "strategy": "ddp", "num_workers": 2}, {"trial": "b", "strategy": "zero-3", "num_workers": 2}]
    same = [rec("a", "ddp", 0, 9.0), rec("a", "ddp", 10, 7.0), rec("b", "zero-3", 0, 9.0), rec("b", "zero-3", 10, 7.0001)]
    assert reproduce.judge_identical(same, trials).outcome == "held"
    same[-1]["val_loss"] = 7.01
    v = reproduce.judge_identical(same, trials)
    assert v.outcome == "not held" and "1.4e-03" in v.summary


def test_memory_judges_compare_with_data_parallel():
    def rec(trial, census, theory, peak):
        return {"trial": trial, "mem_model_state_census_bytes": census, "mem_model_state_theory_bytes": theory,
                "mem_model_state_bytes": census, "mem_peak_bytes": peak}
    trials = [{"trial": t, "strategy": s, "num_workers": 4, "mean_step_time_s": 1.0}
              for t, s in (("a", "ddp"), ("b", "zero-3"), ("c", "zero-1"))]
    records = [rec("a", 400 * 2**20, 400 * 2**20, 1200 * 2**20), rec("b", 100 * 2**20, 100 * 2**20, 500 * 2**20),
               rec("c", 250 * 2**20, 250 * 2**20, 1000 * 2**20)]
    v = reproduce.judge_zero_memory(records, trials)
    assert v.outcome == "held" and "75% less per worker than ddp on 4 workers (zero-3)" in v.summary
    assert "| zero-3 | 4 | 100.0 | 75% | 100.0 | 75% | 100.0 | 500.0 | 58% |" in v.table
    records[1]["mem_model_state_census_bytes"] = 300 * 2**20
    v = reproduce.judge_zero_memory(records, trials)  # zero-1's 38% cut is now the best: below the study's 42%
    assert v.outcome == "partly" and "below the study's range" in v.summary

    mt = [{"trial": f"t{t}", "strategy": "megatron", "num_workers": t,
           "overrides": '{"strategy": {"name": "megatron", "tensor_parallel": %d}}' % t} for t in (1, 2, 4)]
    peaks = {1: 900, 2: 700, 4: 800}
    records = [rec(f"t{t}", 10, 10, peaks[t] * 2**20) for t in peaks]
    v = reproduce.judge_megatron(records, mt)
    assert v.outcome == "held" and "a U: lowest at T=2" in v.summary
    assert reproduce.judge_megatron(records[:2], mt[:2]).outcome == "partly"


def test_every_finding_names_the_commit_reproduce_started_from(monkeypatch, tmp_path):
    """The findings after the first would otherwise name the commit with '+changes': the pages the ones
    before them wrote are tracked files."""
    commits = iter(["fd5b879", "fd5b879+changes"])
    monkeypatch.setattr(reproduce, "provenance_commit", lambda: next(commits))
    named = []

    def run_finding(pl, out, address=None, log=None, commit=None):
        named.append(commit)
        return tmp_path / pl.finding.name, reproduce.Verdict("held", "", ""), 1.0

    monkeypatch.setattr(reproduce, "run_finding", run_finding)
    assert cli.main(["reproduce", "staleness", "identical-curves", "--out", str(tmp_path)]) == 0
    assert named == ["fd5b879", "fd5b879"]
