"""What the benchmarks publish: a page under docs/ with how it was made, and the README's line saying
whether the benchmark's target was met (benchmarks/common.py)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def common(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("common", REPO / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "common", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "README", tmp_path / "README.md")
    monkeypatch.setattr(module, "DOCS", tmp_path / "docs")
    return module


README = """# x

## Targets

<!-- target speed -->
<!-- /target -->
<!-- target other -->
- [Other](docs/other.md): kept (2 CPU cores, 2026-01-01, commit `abc`)
<!-- /target -->

## Documentation
"""


def test_the_readme_line_is_replaced_and_the_rest_kept(common, tmp_path):
    (tmp_path / "README.md").write_text(README)
    made = {"date": "2026-12-02 08:00 UTC", "commit": "1234567", "machine": {"cpu_count": 2}, "command": "python b.py"}
    common.check_readme_target("speed", None)
    for ratio in ("1.20", "1.02"):
        page = common.write_page("speed", "Speed", "body", verdict=f"ratio {ratio}: **met**", made=made)
    text = (tmp_path / "README.md").read_text()
    assert text == README.replace("<!-- target speed -->\n", "<!-- target speed -->\n- [Speed](docs/speed.md): "
                                  "ratio 1.02: **met** (2 CPU cores, 2026-12-02, commit `1234567`)\n")
    assert page == tmp_path / "docs" / "speed.md" and "commit `1234567`" in page.read_text()


def test_a_page_written_elsewhere_leaves_the_readme(common, tmp_path):
    (tmp_path / "README.md").write_text(README)
    common.write_page("speed", "Speed", "body", out=str(tmp_path / "elsewhere.md"), verdict="**NOT met**")
    assert (tmp_path / "README.md").read_text() == README and (tmp_path / "elsewhere.md").exists()


def test_a_first_verdict_gets_a_block_after_the_others(common, tmp_path):
    (tmp_path / "README.md").write_text(README)
    made = {"date": "2026-12-02 08:00 UTC", "commit": "1234567", "machine": {"cpu_count": 2}, "command": "python b.py"}
    common.check_readme_target("new", None)
    for ratio in ("0.5", "0.7"):
        common.write_page("new", "New", "body", verdict=f"ratio {ratio}: **NOT met**", made=made)
    assert (tmp_path / "README.md").read_text() == README.replace(
        "kept (2 CPU cores, 2026-01-01, commit `abc`)\n<!-- /target -->\n",
        "kept (2 CPU cores, 2026-01-01, commit `abc`)\n<!-- /target -->\n<!-- target new -->\n- [New](docs/new.md): "
        "ratio 0.7: **NOT met** (2 CPU cores, 2026-12-02, commit `1234567`)\n<!-- /target -->\n")


def test_a_readme_without_target_blocks_is_refused_before_the_benchmark_runs(common, tmp_path):
    (tmp_path / "README.md").write_text("# x\n\n## Targets\n\n## Documentation\n")
    with pytest.raises(SystemExit, match=r"README.md has no `<!-- target NAME -->` .* fix: add one under '## Targets'"):
        common.check_readme_target("speed", None)
    common.check_readme_target("speed", str(tmp_path / "page.md"))  # a page elsewhere writes no README line


def _reference_records(noise) -> list[dict]:
    """A reference at batch 16 whose loss falls from 9 to below log(80) over 200 steps, as measured
    curves do: 90% of the way in the first 20 steps, the rest slowly; the noise scale noise(step) is
    measured at each evaluation."""
    end = math.log(80) - 0.05

    def way(s):
        return 0.9 * s / 20 if s <= 20 else 0.9 + 0.1 * (s - 20) / 180
    return [{"step": s, "global_batch_size": 16, "wall_time_s": 0.1 * s,
             "val_perplexity": math.exp(9 - (9 - end) * way(s)),
             "grad_noise_scale": noise(s) if s else None} for s in range(0, 201, 10)]


@pytest.mark.parametrize("noise, saves", [(lambda s: 10.0, True), (lambda s: 1 + 40 * (s / 200) ** 3, False)],
                         ids=["constant noise", "noise growing near the target"])
def test_the_reference_fraction_page_ranks_batches_as_a_reference_stopped_short_would(common, tmp_path, monkeypatch,
                                                                                    noise, saves):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_par.metrics.goodput import fit_reference
    records = _reference_records(noise)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "metrics.parquet")
    spec = importlib.util.spec_from_file_location("reference_fraction", REPO / "benchmarks" / "reference_fraction.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out, page = tmp_path / "r.json", tmp_path / "page.md"
    monkeypatch.setattr(sys, "argv", ["reference_fraction.py", "--records", str(tmp_path / "metrics.parquet"),
                                      "--out", str(out), "--page", str(page)])
    bench.main()
    rows = json.loads(out.read_text())["fractions"]
    whole = fit_reference(records, "val_perplexity", 80, "min")  # what plan computes
    assert rows[-1]["fraction"] == 1 and rows[-1]["steps"] == pytest.approx(whole.steps)
    assert rows[-1]["noise_scale"] == pytest.approx(whole.noise_scale)
    assert [r["time_share"] for r in rows] == sorted(r["time_share"] for r in rows) and rows[-1]["time_share"] == 1
    text = page.read_text()
    assert ("From 25% of the way on" in text) is saves  # constant noise: any fraction ranks the batches alike
    assert ("favours small batches" in text) is not saves


def _tp_row(layout, workers, tp, dp, params, activations, tp_bytes, tp_formula, step=1.0):
    return {"layout": layout, "workers": workers, "step_time_s": step, "mem_param_bytes": params,
            "mem_model_state_bytes": 4 * params, "mem_activation_bytes": activations, "mem_peak_bytes": 10 * params,
            "tp_allreduce_bytes": tp_bytes, "dp_allreduce_bytes": params if dp > 1 else 0, "tp_size": tp,
            "dp_size": dp, "paper_tp_layer_bytes": tp_formula, "tp_formula_bytes": tp_formula,
            "dp_formula_bytes": params if dp > 1 else 0, "wire_bytes_per_worker": tp_formula}


@pytest.mark.parametrize("measured, says", [(36 << 20, "equals the formula to the byte"),
                                            (35 << 20, "differs from the formula in megatron T=2")])
def test_the_tensor_parallel_page_reads_its_findings_off_the_rows(common, tmp_path, measured, says):
    from types import SimpleNamespace
    spec = importlib.util.spec_from_file_location("tensor_parallel", REPO / "benchmarks" / "tensor_parallel.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    mb = 1 << 20
    rows = [_tp_row("ddp x2", 2, 1, 2, 20 * mb, 146 * mb, 0, 0, step=0.5),
            _tp_row("megatron T=1", 1, 1, 1, 20 * mb, 292 * mb, 0, 0),
            _tp_row("megatron T=2", 2, 2, 1, 10 * mb, 164 * mb, measured, 36 * mb, step=2.0)]
    args = SimpleNamespace(model="gpt2-mini", batch=16, seq_len=128, device="cpu", steps=6, repeats=1)
    page = tmp_path / "tp.md"
    bench.render(rows, args, {"n_layer": 4, "n_embd": 256, "n_head": 4}, str(page), common.provenance())
    text = page.read_text()
    assert says in text
    assert "2·A(2) − A(1) = W = 36.0 MiB" in text  # 2 x 164 - 292
    assert "(4L + 2)·b·s·h floats, are 36.0 MiB" in text  # 4 bytes x 18 x 16 x 128 x 256
    assert "megatron T = 2 took 4.00× DDP's step time" in text
    assert "| megatron T=2 | 2 | 2000 | 10.0 |" in text


def test_the_overhead_line_says_the_target_and_the_ratio_with_the_same_allocator(common, tmp_path, monkeypatch):
    """benchmarks/overhead.py --render: the verdict is ours against the plain script as a user runs it;
    the line and the page also say where ours is above the target against the plain script given our
    workers' allocator settings, so that the allocator's share is never passed off as ours."""
    (tmp_path / "README.md").write_text(README.replace("target speed", "target overhead"))
    spec = importlib.util.spec_from_file_location("overhead", REPO / "benchmarks" / "overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "write_page", common.write_page)

    def result(ours, plain, cached):
        return {"ours_s": [ours], "plain_s": [plain], "plain_cached_s": [cached], "round_ratios": [ours / plain],
                "ratio": ours / plain, "met": ours / plain <= bench.TARGET, "same_allocator_ratio": ours / cached,
                "same_allocator_round_ratios": [ours / cached]}

    run = {"date": "2026-12-03 13:13 UTC", "commit": "1234567", "machine": {"cpu_count": 2}, "command": "python o.py",
           "rounds": 1, "warmup": 5, "in_process_rounds": 0, "cpu_seconds": 0, "cpu_cores_by_process": {},
           "setup": "gpt2-tiny", "host_allocator": "caching", "results": {"ddp": result(0.50, 0.60, 0.49), "fsdp": result(0.54, 0.66, 0.50)}}
    bench.render(run, None)
    line = next(x for x in (tmp_path / "README.md").read_text().splitlines() if x.startswith("- [Overhead"))
    assert ("ours / plain 0.82-0.83 over ddp, fsdp (target: at most 1.05 each): **met**, our workers' caching host "
            "allocator against glibc's defaults" in line)
    assert "ours / plain given the same allocator settings 1.02-1.08: **NOT met**, above for fsdp" in line
    page = (tmp_path / "docs" / "overhead.md").read_text()
    assert "Written by `python o.py`" in page and "| fsdp | torch FSDP2 | 0.5400 | 0.6600 | 0.818 | met |" in page
