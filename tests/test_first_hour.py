"""What a new user reads: the profiles installed, a stale profile said, MFU only where it means something, every
abbreviation of search's tables spelled out, a tie said when the top plans lie within each other's intervals."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

from typer.testing import CliRunner

from cli.main import app
from parsim.hardware import list_profiles, load_profile
from parsim.machine import mfu_text
from parsim.plan import Plan
from parsim.plan_schema import PLAN_FIELDS
from parsim.plan_text import SHORT_AC, SHORT_AXES, SHORT_DOMINANT, WRAPPER_LETTERS, legend
from parsim.search import RankedPlan


def test_profiles_lists_every_installed_profile():
    r = CliRunner().invoke(app, ["profiles", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["profiles"]
    assert [x["name"] for x in rows] == list_profiles()
    cpu = next(x for x in rows if x["name"] == "cpu-gloo-2")
    assert cpu["kind"].startswith("measured cpu") and cpu["date"] == "2026-11-22" and cpu["ranks"] == 2
    assert cpu["this_machine"] in ("yes",) or cpu["this_machine"].startswith("no: ")
    assert next(x for x in rows if x["name"] == "h100-sxm-spec")["this_machine"] == ""  # hardware elsewhere
    r = CliRunner().invoke(app, ["profiles"])
    assert r.exit_code == 0 and all(name in r.output for name in list_profiles()), r.output


def test_predict_says_when_its_profile_is_stale(monkeypatch):
    import parsim.machine as M

    hw = load_profile("cpu-gloo-2")  # measured before the profiler measured the optimizer step and overheads
    monkeypatch.setattr(M, "this_machine", lambda gpu_name=None: dict(hw.provenance["machine"]))
    r = CliRunner().invoke(app, ["predict", "--model", "tiny", "--gpus", "2", "--dp-shard", "2", "--profile",
                                 "cpu-gloo-2"])
    assert r.exit_code == 0 and "profile cpu-gloo-2 is stale" in r.output and "optimizer_fixed_s" in r.output


def test_mfu_is_a_percentage_of_a_device_peak_or_not_shown():
    gpu, cpu = load_profile("h100-sxm-spec"), load_profile("cpu-gloo-2")
    assert mfu_text(0.43, gpu) == "43.0%"
    assert mfu_text(1.3, gpu) == "n/a" and mfu_text(0.2, cpu) == "n/a"
    r = CliRunner().invoke(app, ["predict", "--model", "tiny", "--gpus", "2", "--dp-shard", "2", "--profile",
                                 "cpu-gloo-2-cal", "--param-dtype", "float32"])
    assert r.exit_code == 0 and "MFU n/a" in r.output, r.output
    r = CliRunner().invoke(app, ["predict", "--model", "tiny", "--gpus", "2", "--dp-shard", "2", "--profile",
                                 "cpu-gloo-2-cal", "--param-dtype", "float32", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["mfu"] is None  # the JSON says nothing rather than 4,967%
    r = CliRunner().invoke(app, ["predict", "--model", "llama3-8b", "--gpus", "8", "--dp-shard", "8", "--json"])
    assert 0 < json.loads(r.stdout)["mfu"] < 1


def test_the_legend_spells_out_every_abbreviation_the_tables_use():
    text = legend()
    words = [s for a, s in SHORT_AXES.items() if s != a] + [s for a, s in SHORT_AC.items() if s != a]
    words += list(SHORT_DOMINANT.values()) + [f.letters for f in PLAN_FIELDS if f.letters]
    words += list(WRAPPER_LETTERS.values()) + ["PTACF", "I1F1B", "gaN", "F8r", "F8g", "R- / R+", "LN", "epN", "/vN"]
    missing = [w for w in words if w not in text]
    assert not missing, missing
    r = CliRunner().invoke(app, ["search", "--model", "tiny", "--gpus", "4", "--global-batch-size", "8"])
    assert r.exit_code == 0 and "sel selective-op" in " ".join(r.output.split()), r.output


def _res(steps):
    return SimpleNamespace(top=[RankedPlan(Plan(dp_shard=2), s, 1.0, 1.0, 0.5, "compute_backward") for s in steps])


def test_a_tie_is_said_when_the_top_plans_lie_within_each_others_intervals():
    from cli.views import tie_note

    hw = load_profile("h100-sxm-spec-cal")
    q = math.exp(hw.interval_log_halfwidth_for("dense"))  # Plan(dp_shard=2): a dense plan
    assert q > 1.05
    assert tie_note(_res([1.0, 1.0 * q * q * 1.01]), hw) == ""  # the second one's interval starts above the first's
    note = tie_note(_res([1.0, 1.01, 1.02, 1.0 * q * q * 1.01]), hw)
    assert note.startswith("plans #1-#3 are a tie") and "2.0% apart" in note


def test_tables_fold_rather_than_cut_at_80_columns():
    """A redirected output is 80 columns wide: every cell shows whole (folded), none ends in an ellipsis."""
    r = CliRunner().invoke(app, ["predict", "--model", "llama3-8b", "--gpus", "64", "--dp-shard", "16", "--tp", "4",
                                 "--explain"])
    assert r.exit_code == 0 and "all_gather" in r.output
    assert "…" not in r.output
