"""What the benchmarks publish: a page under docs/ with how it was made, and the README's line saying
whether the benchmark's target was met (benchmarks/common.py)."""

import importlib.util
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


def test_a_readme_without_the_block_is_refused_before_the_benchmark_runs(common, tmp_path):
    (tmp_path / "README.md").write_text(README.replace("<!-- target speed -->\n", ""))
    with pytest.raises(SystemExit, match=r"README.md has no `<!-- target speed -->` .* fix: add one under '## Targets'"):
        common.check_readme_target("speed", None)
    common.check_readme_target("speed", str(tmp_path / "page.md"))  # a page elsewhere writes no README line
