"""Wrapper-order rules: written rules, revision by an observed matrix, searched orders derived from the rules,
disagreements, the AC-wraps-compile factor; the stored matrix of the installed torch; one real executed case."""

import json

import pytest

from parsim import ordering as O
from parsim.plan import DEFAULT_ORDER

SWAPPED = ("pp", "tp", "compile", "ac", "fsdp")


def _row(order, outcome):
    return {"order": list(order), "outcome": outcome, "status": "ok" if outcome != "failed" else "error",
            "error": "" if outcome != "failed" else "RuntimeError: boom"}


def _data(rows_by_case: dict) -> dict:
    return {"torch": "9.9", "cases": {name: {"permuted": list(perm), "rows": [_row(o, out) for o, out in rows]}
                                      for name, (perm, rows) in rows_by_case.items()}}


def test_written_rules():
    assert O.is_legal(DEFAULT_ORDER, O.RULES)
    assert not O.is_legal(("pp", "fsdp", "tp", "ac", "compile"), O.RULES)  # FSDP before TP
    assert not O.is_legal(("pp", "tp", "ac", "fsdp", "compile"), O.RULES)  # compile after FSDP
    assert O.is_legal(SWAPPED, O.RULES)  # legal, only a recommended rule broken
    assert [r.kind for r in O.violations(SWAPPED, O.RULES)] == ["recommended"]
    assert all(r.first in O.WRAPPERS and r.then in O.WRAPPERS for r in O.RULES)


def test_searched_orders_derive_from_the_rules():
    assert O.searched_orders(True, True, O.RULES) == [DEFAULT_ORDER, SWAPPED]
    assert O.searched_orders(True, False, O.RULES) == [DEFAULT_ORDER]
    assert O.searched_orders(False, True, O.RULES) == [DEFAULT_ORDER]
    # a rule forbidding compile before AC leaves one class
    strict = O.RULES + (O.OrderRule("ac", "compile", "observed-fundamental", "test"),)
    assert O.searched_orders(True, True, strict) == [DEFAULT_ORDER]
    # every searched order is legal under the rules it came from and breaks no version-dependent rule
    for o in O.searched_orders(True, True, O.RULES):
        assert O.is_legal(o, O.RULES)
        assert not any(r.kind == "version-dependent" for r in O.violations(o, O.RULES))


def test_observed_matrix_revises_and_adds_rules():
    perm = ("tp", "ac", "compile", "fsdp")
    rows = []
    for o in O.permutations(perm):
        order = ("pp",) + o
        # observed world: FSDP before TP fails, everything else runs; compile after FSDP runs
        rows.append((order, "failed" if order.index("fsdp") < order.index("tp") else "ran"))
    rules = O.observed_rules(_data({"c": (perm, rows)}))
    by = {(r.first, r.then): r for r in rules}
    assert by[("tp", "fsdp")].kind == "observed-fundamental"
    assert by[("compile", "fsdp")].kind == "observed-legal"  # written fundamental, observed to run
    assert by[("tp", "ac")].kind == "observed-legal"  # version-dependent, ran
    assert by[("ac", "compile")].kind == "recommended"  # unchanged: runs either way, costs differ
    assert O.is_legal(("pp", "tp", "ac", "fsdp", "compile"), rules)
    assert not O.is_legal(("pp", "fsdp", "tp", "ac", "compile"), rules)
    # a pair the written rules do not name, failing one way only, becomes a rule
    rows2 = [(("pp", "tp") + o, "failed" if o.index("fsdp") < o.index("ac") else "ran")
             for o in O.permutations(("ac", "compile", "fsdp"))]
    added = [r for r in O.observed_rules(_data({"d": (("ac", "compile", "fsdp"), rows2)}))
             if (r.first, r.then) == ("ac", "fsdp")]
    assert len(added) == 1 and added[0].forbids


def test_disagreements_are_listed_both_ways():
    perm = ("tp", "fsdp")
    data = _data({"c": (perm, [(DEFAULT_ORDER, "ran"), (("pp", "fsdp", "ac", "compile", "tp"), "ran"),
                               (("pp", "tp", "ac", "compile", "fsdp"), "differs")])})
    d = O.disagreements(data)
    assert {(tuple(x["order"]), x["observed"]) for x in d} == {(("pp", "fsdp", "ac", "compile", "tp"), "ran"),
                                                               (("pp", "tp", "ac", "compile", "fsdp"), "differs")}
    doc = O.orders_document(data)
    rows = doc["cases"]["c"]["rows"]
    assert [r["written_rules_predict"] for r in rows] == ["runs", "fails", "runs"]
    assert doc["disagreements"] == d


def test_ac_wraps_compile_factor(monkeypatch):
    monkeypatch.setattr(O, "observed", lambda: None)
    assert O.ac_wraps_compile_recompute_factor() == O.ASSUMED_AC_WRAPS_COMPILE_FACTOR
    monkeypatch.setattr(O, "observed", lambda: {"ac_wraps_compile": {"recompute_factor": 1.3}})
    assert O.ac_wraps_compile_recompute_factor() == 1.3
    monkeypatch.setattr(O, "observed", lambda: {"ac_wraps_compile": {"recompute_factor": 0.7}})
    assert O.ac_wraps_compile_recompute_factor() == 1.0  # recomputing less than once is noise


def test_stored_matrix_is_well_formed():
    store = json.loads(O.ORDERS_FILE.read_text())
    assert store["by_torch_version"]
    for version, data in store["by_torch_version"].items():
        assert data["torch"] == version
        for case in data["cases"].values():
            first = case["rows"][0]
            assert tuple(first["order"]) == DEFAULT_ORDER and first["outcome"] == "ran"
            for r in case["rows"]:
                assert r["outcome"] in ("ran", "failed", "differs")
                assert (r["outcome"] == "failed") == (r["status"] != "ok")
        # the searched orders derived from this data are legal under it
        rules = O.observed_rules(data)
        for o in O.searched_orders(True, True, rules):
            assert O.is_legal(o, rules)


def test_orders_help_names_every_case():
    """The CLI's --case help is written out (the CLI does not import torch for it): it names every case."""
    import inspect

    pytest.importorskip("torch")
    from cli import main
    from parsim.executor.orders import CASES

    helped = inspect.signature(main.orders).parameters["case"].default.help
    assert set(helped.split(": ", 1)[1].split(", ")) == set(CASES)


@pytest.mark.slow
def test_orders_case_executes_every_permutation(tmp_path):
    pytest.importorskip("torch")
    import torch

    from parsim.executor.orders import orders_of, run_orders

    out = tmp_path / "orders.json"
    kept = {"cases": {"other": {"rows": []}}, "ac_wraps_compile": {"factor": 1.4}}
    out.write_text(json.dumps({"by_torch_version": {torch.__version__.split("+")[0]: kept}}))
    data = run_orders(["pp-tp"], str(out), steps=1, timeout_s=300, cost_repeats=0)
    rows = data["cases"]["pp-tp"]["rows"]
    assert [tuple(r["order"]) for r in rows] == orders_of(("pp", "tp"))
    assert rows[0]["outcome"] == "ran" and rows[0]["max_loss_diff"] == 0.0
    assert all(r["outcome"] in ("ran", "failed", "differs") for r in rows)
    stored = json.loads(out.read_text())["by_torch_version"][data["torch"]]
    assert stored["cases"]["pp-tp"]["rows"] == rows
    # the cases and the cost measured before are kept
    assert stored["cases"]["other"] == kept["cases"]["other"] and stored["ac_wraps_compile"] == {"factor": 1.4}


def test_run_refuses_an_order_that_breaks_a_forbidding_rule_between_applied_wrappers(monkeypatch):
    """`parsim run` refuses compile before TP (observed: other losses) in one line, exit 2, nothing launched; the
    same order with compile off (the rule does not bind: compile's position changes nothing) reaches the launcher."""
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    import parsim.executor.launch as launch
    from parsim.cli.main import app
    from parsim.plan import Plan
    from parsim.results import Measurement

    rules = O.RULES + (O.OrderRule("tp", "compile", "observed-fundamental", "other losses (test)"),)
    monkeypatch.setattr(O, "effective_rules", lambda: rules)
    bad = ("pp", "compile", "ac", "tp", "fsdp")
    plan = Plan(dp_shard=2, tp=2, compile=True, wrapper_order=bad)
    assert "puts compile before tp" in O.order_refusal(plan) and "other losses (test)" in O.order_refusal(plan)
    assert O.order_refusal(Plan(dp_shard=2, tp=2, compile=False, wrapper_order=bad)) == ""
    assert O.order_refusal(Plan(dp_shard=4, tp=1, compile=True, wrapper_order=bad)) == ""  # tp off
    assert O.order_refusal(Plan(dp_shard=2, tp=2, compile=True)) == ""
    launched = []

    def record(model, plan, *a, **kw):
        launched.append(plan)
        return Measurement(plan_id=plan.plan_id, kind="run", status="error", error="recorded, not launched")

    monkeypatch.setattr(launch, "run_plan", record)
    base = ["run", "--model", "tiny", "--gpus", "4", "--dp-shard", "2", "--tp", "2", "--order", ",".join(bad),
            "--nproc-per-node", "4", "--json"]
    r = CliRunner().invoke(app, base + ["--compile"])
    assert r.exit_code == 2 and not launched
    assert "puts compile before tp" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 1, r.output  # launched; the recorded run's status (error) ends the command with exit 1
    assert len(launched) == 1 and launched[0].wrapper_order == bad
