"""README.md's results block is generated from the runs' saved outputs (tools/readme_results.py) and
current: its numbers come from the files its campaigns name, each campaign's file and record exist
and the records index links the record; the gate renderer reads the ``cause`` stage's rows."""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import pytest

from behaviortrace_jax.attribution import causal_gate as cg, formats

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("readme_results", REPO / "tools" / "readme_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_the_readme_results_block_is_current(tool):
    text = tool.README.read_text()
    assert tool.rewrite(text, tool.render_block()) == text, "run python tools/readme_results.py"
    assert tool.main(["--check"]) == 0


def test_every_campaign_names_a_saved_file_and_an_indexed_record(tool):
    index = (REPO / "docs" / "records" / "README.md").read_text()
    text = tool.README.read_text()
    for c in tool.CAMPAIGNS:
        assert c.kind in tool.KINDS, c
        assert (REPO / c.source).is_file() and c.source.startswith("docs/records/"), c.source
        assert (REPO / c.record).is_file(), c.record
        assert f"({pathlib.PurePath(c.record).name})" in index, f"docs/records/README.md does not link {c.record}"
        block = text[text.index(tool.BEGIN):text.index(tool.END)]
        assert f"`{c.source}`" in block and f"({c.record})" in block


def test_the_numbers_come_from_the_file(tool, tmp_path):
    """Change one value of a copy of the default's saved table: the rendered cell follows it; drop
    the metagradient rows: its README row goes."""
    src = REPO / "docs" / "records" / "tiny_sweep" / "results_table.csv"
    rows = formats.read_results_csv(src)
    changed = [dataclasses.replace(r, value=0.98765) if (r.seed, r.table, r.method) == ("0", "which_rollout", "C1-dot")
               else r for r in rows if r.method != "metagradient"]
    formats.write_results_csv(tmp_path / "results_table.csv", changed)
    camp = tool.Campaign("default", "results_table.csv", "docs/records/x.md", "which_rollout")
    block = tool.render_block([camp], repo=tmp_path)
    assert "| C1-dot (weighted / direction) | 0.988 / 0.317 |" in block
    assert "| metagradient |" not in block
    assert "| | default, seed 0 |" in block and "`results_table.csv` (default)" in block
    # the same file as saved renders the README's cell
    formats.write_results_csv(tmp_path / "results_table.csv", rows)
    assert "| C1-dot (weighted / direction) | 0.512 / 0.317 |" in tool.render_block([camp], repo=tmp_path)


def test_halves_round_up_and_missing_cells_show_a_dash(tool):
    assert tool._fixed(0.3125, 3) == "0.313" and tool._fixed(0.2475, 3) == "0.248" and tool._fixed(368.0, 0) == "368"
    assert tool._join(["0.1", None]) == "0.1 / -" and tool._join(["368,", "0.334"]) == "368, 0.334"
    assert tool._join(["0.386", "(0.386)"]) == "0.386 (0.386)"


def test_the_gate_renders_from_the_cause_stage_rows(tool, tmp_path):
    base = {"probe_rate": [0.26, 0.30, 0.36], "logp_margin": [-0.05, -0.08, 0.22]}
    held = {"probe_rate": [0.06], "logp_margin": [0.0]}
    rep = cg.gate_measures(base, held, primary="probe_rate", sampling_se={"probe_rate": [0.05] * 3})
    path = tmp_path / "causal" / "cause_rows.csv"
    path.parent.mkdir()
    formats.write_results_csv(path, cg.gate_rows("0", rep) + cg.gate_rows("1", rep))
    camp = tool.Campaign("tiny causal", "causal/cause_rows.csv", "docs/records/y.md", "causal_gate")
    block = tool.render_block([camp], repo=tmp_path)
    assert "### The causal gate (replays)" in block
    probe, margin = rep.verdicts
    e, g = probe.effect, (lambda x: f"{round(x, 4):.4g}")  # the CSV holds round(x, 4)
    assert (f"| tiny causal, seed 0 | probe_rate (primary) | {g(e.delta)} [{g(e.ci_low)}, {g(e.ci_high)}] | "
            f"{g(probe.floor.sd)} | {g(probe.mde)} | {g(probe.delta_over_sd)} | acted | 3 |") in block
    assert f"| tiny causal, seed 1 | logp_margin | {g(margin.effect.delta)} [" in block
    assert "| not detected | 3 |" in block
    # a campaign may show some measures only
    only = tool.render_block([tool.Campaign("tiny causal", "causal/cause_rows.csv", "docs/records/y.md", "causal_gate",
                                            measures=("probe_rate",))], repo=tmp_path)
    assert "probe_rate (primary)" in only and "logp_margin" not in only
    # a gate table without one of its rows is named
    rows = [r for r in formats.read_results_csv(path) if not (r.seed == "1" and r.method == "mde")]
    formats.write_results_csv(path, rows)
    with pytest.raises(ValueError, match=r"seed 1 table causal_gate\[probe_rate\] lacks the rows \['mde'\]"):
        tool.render_block([camp], repo=tmp_path)


def test_bad_campaigns_and_markers_are_named(tool, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="nope.csv does not exist"):
        tool.render_block([tool.Campaign("x", "nope.csv", "r.md", "which_rollout")], repo=tmp_path)
    with pytest.raises(ValueError, match="unknown kinds \\['nope'\\]"):
        tool.render_block([tool.Campaign("x", "nope.csv", "r.md", "nope")], repo=tmp_path)
    with pytest.raises(ValueError, match="must hold the line"):
        tool.rewrite("# README\n", "block")
    stale = tmp_path / "README.md"
    stale.write_text(tool.README.read_text().replace("| abs-advantage (\\|A\\|) | 0.", "| abs-advantage (\\|A\\|) | 9.", 1))
    assert stale.read_text() != tool.README.read_text()  # a value of the generated block changed
    monkeypatch.setattr(tool, "README", stale)
    assert tool.main(["--check"]) == 1
    assert tool.main([]) == 0 and tool.main(["--check"]) == 0
