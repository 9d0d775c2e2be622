"""The plan schema is the one place a plan field is declared: Plan, PlanBatch, the codec, the CLI flags, the
flags' defaults, search's pins, the report words, the table letters, the executor's refusal and the emitters' gaps
are derived from its rows. Tested both ways: every row round-trips through every consumer, and a dummy option
added to the schema alone (in a fresh interpreter) reaches all of them."""

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from parsim import flags
from parsim.codec import COLUMN_NAMES, decode, encode, names
from parsim.plan import Plan
from parsim.plan_schema import FIELDS, LATE_DEFAULTS, PINNED, PLAN_FIELDS


def test_plan_fields_are_the_schema_rows():
    got = [(f.name, f.default) for f in dataclasses.fields(Plan)]
    assert got == [(f.name, f.default) for f in PLAN_FIELDS]
    assert LATE_DEFAULTS == {f.name: f.default for f in PLAN_FIELDS if f.late}
    # one default per field: the command line's equals the Plan's wherever it is not derived from other flags
    for f in PLAN_FIELDS:
        if f.cli_default is None or f.name == "dp_shard":
            continue
        want = ",".join(f.default) if f.kind == "order" else f.default
        assert flags.DEFAULTS["order" if f.name == "wrapper_order" else f.name] == want, f.name


def _values(f):
    """Every value a field can take that is not its default (a few for integers)."""
    if f.kind == "choice":
        return [c for c in f.choices if c != f.default]
    if f.kind in ("bool", "optional_bool"):
        return [not f.default] if f.kind == "bool" else [True, False]
    if f.kind == "ac":
        return ["full", "selective-op", "layer:3"]
    if f.kind == "order":
        return [tuple(reversed(f.choices))]
    return [2, 4]


@pytest.mark.parametrize("f", PLAN_FIELDS, ids=lambda f: f.name)
def test_every_field_round_trips_through_the_batch_and_json(f):
    base = dict(pp=2, tp=2, dp_replicate=2, dp_shard=2, local_batch_size=4, micro_batch_size=2)
    for v in _values(f):
        kw = {**base, f.name: v}
        if f.name == "pp_stages_per_rank":
            kw["pp_schedule"] = "Interleaved1F1B"
        plan = Plan(**kw)
        assert decode(encode([plan], 8), 0) == plan
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
        if f.kind == "choice":
            assert names(encode([plan], 8))[f.name][0] == v
    assert set(COLUMN_NAMES) >= {f.column for f in PLAN_FIELDS}


def test_late_fields_leave_the_plan_id_alone_at_their_default():
    plan = Plan(tp=2)
    d = {k: v for k, v in plan.to_dict().items() if k not in LATE_DEFAULTS}
    assert Plan.from_dict(d).plan_id == plan.plan_id
    for name in LATE_DEFAULTS:
        other = _values(FIELDS[name])[0]
        assert Plan(**{**d, name: other}).plan_id != plan.plan_id, name


def test_pinned_options_reach_every_searched_plan():
    from parsim.hardware import load_profile
    from parsim.search import search
    from parsim.spec import load_model

    given = {"gpus": 8, "global_batch_size": 8, "seq_len": 1024, "async_tp": True, "fused_loss": True,
             "distributed_optimizer": True, "float8_recipe": "rowwise", "sequence_parallel": False}
    gpus, sp = flags.search_space(given)
    assert {name for name, _ in sp.pins} == {f.name for f in PINNED if f.name in given}
    res = search(load_model("llama3-8b"), load_profile("h100-sxm-spec-cal"), gpus, sp, top_k=30)
    assert res.top
    for row in res.top:
        p = row.plan
        assert p.fused_loss and p.float8_recipe == "rowwise" and not p.sequence_parallel
        assert p.async_tp == (p.tp > 1) and p.distributed_optimizer == (p.dp_replicate > 1)


DUMMY = """
import dataclasses, json, sys
import parsim.plan_schema as S

S.PLAN_FIELDS = S.PLAN_FIELDS + (S.PlanField(
    "dummy_option", "bool", False, late=True, label="dummy words", letters="DUM", help="a dummy", shown_default="[no]",
    executor_refusal="dummy: not run", torchtitan_gap="dummy: no torchtitan", megatron_gap="dummy: no megatron"),)
S.FIELDS = {f.name: f for f in S.PLAN_FIELDS}
S.LATE_DEFAULTS = {f.name: f.default for f in S.PLAN_FIELDS if f.late}
S.PINNED = tuple(f for f in S.PLAN_FIELDS if f.search == "pinned")

from typer.testing import CliRunner
from parsim.cli.main import app
from parsim.plan_text import short_options
from parsim.codec import decode, encode, executor_refusal
from parsim.emit import megatron_gaps, torchtitan_gaps
from parsim.plan import Plan
from parsim.report import option_labels
from parsim.spec import load_model

out = {}
plan = Plan(tp=2, dummy_option=True)
out["round_trip"] = decode(encode([plan], 8), 0) == plan
out["id_unchanged_at_default"] = Plan(tp=2).plan_id == sys.argv[1]
out["id_changes_when_on"] = plan.plan_id != sys.argv[1]
out["refusal"] = executor_refusal(plan)
spec = load_model("llama3-8b")
out["gaps"] = [g for g in torchtitan_gaps(plan, spec, "0.3.0") + megatron_gaps(plan, spec) if g.startswith("dummy")]
out["words"] = (option_labels(plan), short_options(plan))
r = CliRunner().invoke(app, ["predict", "--gpus", "2", "--tp", "2", "--dummy-option", "--json"])
out["predict"] = json.loads(r.output)["plan"].get("dummy_option") if r.exit_code == 0 else r.output
r = CliRunner().invoke(app, ["search", "--gpus", "8", "--global-batch-size", "8", "--dummy-option", "--json"])
out["search"] = all(p["plan"]["dummy_option"] for p in json.loads(r.output)["top"]) if r.exit_code == 0 else r.output
print(json.dumps(out))
"""


def test_a_dummy_option_in_the_schema_alone_reaches_every_consumer():
    """Adding a plan option is a schema row (plus its cost term and test): the row, added here in a fresh
    interpreter before anything else is imported, is a Plan field, a batch column, a CLI flag that predict and
    search honour, part of the plan id only when on, a report word, a table letter, an executor refusal and an
    emitter gap."""
    code = textwrap.dedent(DUMMY)
    r = subprocess.run([sys.executable, "-c", code, Plan(tp=2).plan_id], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"round_trip": True, "id_unchanged_at_default": True, "id_changes_when_on": True,
                   "refusal": "dummy_option: cost model only: dummy: not run",
                   "gaps": ["dummy: no torchtitan", "dummy: no megatron"],
                   "words": [["dummy words"], "DUM"], "predict": True, "search": True}


def _plan_values(draw):
    """A Plan's fields drawn from the schema rows (degrees and batch sizes small; orders permuted)."""
    from hypothesis import strategies as st

    out = {}
    for f in PLAN_FIELDS:
        if f.kind == "int":
            out[f.name] = draw(st.sampled_from((1, 2, 4) if f.name not in ("seq_len",) else (256, 1024, 4096)))
        elif f.kind in ("choice", "bool"):
            out[f.name] = draw(st.sampled_from(f.choices or (False, True)))
        elif f.kind == "optional_bool":
            out[f.name] = draw(st.sampled_from((None, False, True)))
        elif f.kind == "ac":
            out[f.name] = draw(st.sampled_from(("none", "full", "selective-op", "layer:2")))
        else:
            out[f.name] = tuple(draw(st.permutations(f.choices)))
    if out["pp"] == 1:
        out["micro_batch_size"] = out["local_batch_size"]
    out["global_batch_size"] *= out["local_batch_size"] * out["dp_replicate"] * out["dp_shard"]
    return out


def _flags_of(plan) -> dict:
    """The command line's flags that say ``plan`` (every flag given, orders as a,b,c text)."""
    given = {"model": "llama3-8b", "model_given": True, "profile": "h100-sxm-spec", "plan_file": None,
             "gpus": plan.world_size}
    for key, f in flags.FLAG_FIELDS.items():
        v = getattr(plan, f.name)
        given[key] = ",".join(v) if f.kind == "order" else v
    return given


def test_the_flags_that_say_a_plan_build_that_plan():
    """Two roads to one plan: a Plan built from drawn fields, and the command line's flags that say it
    (``flags.plan_from_given``, every flag from the schema): the same plan, id included, or both refuse."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from parsim.codec import validate_plan
    from parsim.errors import ParsimError

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.composite(_plan_values)())
    def check(values):
        try:
            plan = Plan(**values)
            validate_plan(plan)
        except ParsimError:
            return
        got = flags.plan_from_given(_flags_of(plan))
        assert got == plan and got.plan_id == plan.plan_id

    check()


def test_choice_codes_name_every_choice_of_their_column():
    """Each choice column's IntEnum names every choice of its schema tuple, with the code a PlanBatch holds."""
    from parsim import plan_schema as S

    for enum, choices in ((S.RafMode, S.RAF_MODES), (S.EpFrom, S.EP_FROM), (S.Float8Recipe, S.FLOAT8_RECIPES),
                          (S.AttentionKernel, S.ATTENTION_KERNELS), (S.GradSync, S.GRAD_SYNCS)):
        assert [m.name.lower().replace("_", "-") for m in enum] == [c.replace("_", "-") for c in choices]
        assert [int(m) for m in enum] == list(range(len(choices)))
