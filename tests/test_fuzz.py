"""Property-based tests (hypothesis, derandomized so CI is deterministic): every outcome of every input is a result
with finite numbers or one line + exit 2, and every flag given is honoured.

Case counts in CI (5,090 in all, in this module; ``PARSIM_FUZZ_SCALE`` multiplies them, ``bench/fuzz_cli.py``):
CLI predict 250, CLI search 40, CLI run/trace arguments 300 (the launcher replaced by a recorder: what is tested is
that bad input stops before anything is launched and that good input reaches the launcher as the plan asked for),
model specs 1,500, plans 1,500, profiles 1,500.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from itertools import permutations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from parsim.cli.main import main
from parsim.codec import validate_plan
from parsim.costmodel import predict
from parsim.errors import ParsimError
from parsim.hardware import HardwareProfile, load_profile
from parsim.plan import AXES, WRAPPERS, Plan
from parsim.spec import PRESETS, ModelSpec

SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
SCALE = int(os.environ.get("PARSIM_FUZZ_SCALE", "1"))  # bench/fuzz_cli.py runs more cases


def n_cases(n: int) -> int:
    return n * SCALE


def call(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _no_nan(text: str):
    def bad(c):
        raise AssertionError(f"non-finite number {c} in JSON output")

    return json.loads(text, parse_constant=bad)


def _finite_numbers(obj, path="") -> None:
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return
    if isinstance(obj, (int, float)):
        assert math.isfinite(obj), path
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _finite_numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _finite_numbers(v, f"{path}[{i}]")


def assert_clean_outcome(rc: int, out: str, err: str) -> dict | None:
    """Exit 0 with one finite JSON document, or exit 2 with exactly one 'error: ...' line and nothing on stdout.
    'warning: ...' lines may precede it (e.g. a committed CPU profile measured on another machine than this one)."""
    assert "Traceback" not in err and "Traceback" not in out, err[-2000:]
    assert rc in (0, 2), (rc, err)
    event(f"exit {rc}")
    if rc == 2:
        lines = [ln for ln in err.strip().splitlines() if not ln.startswith("warning: ")]
        assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) > 8, err
        assert out == ""
        return None
    doc = _no_nan(out)
    _finite_numbers(doc)
    return doc


# ---- argument grammar: valid values mixed with the invalid ones a fuzzer (or a user) tries ---------------------------
INTS = st.sampled_from(["1", "2", "4", "8", "2", "4", "-1", "0", "3", "2097152", "9223372036854775808", "abc", "1.5"])
SMALL_GPUS = st.sampled_from(["1", "2", "4", "8", "8", "16", "0", "-4", "3", "abc", "2097152"])
BATCH = st.sampled_from(["1", "2", "4", "8", "16", "0", "-1", "33554432", "x"])
SEQ = st.sampled_from(["64", "128", "256", "1024", "4096", "0", "-5", "3", "33554432", "100000000000000000000"])


def _orders(names):
    perms = [",".join(p) for p in permutations(names)]
    return st.one_of(st.sampled_from(perms), st.sampled_from(["garbage", "tp,tp", "", "pp,,tp"]))


MESH = st.one_of(_orders(AXES), st.sampled_from(["tp,dp_shard", "dp_shard,tp", "pp,tp", "tp"]))
FLAG_VALUES = {
    "--dp-replicate": INTS, "--dp-shard": INTS, "--tp": INTS, "--pp": INTS, "--cp": INTS, "--ep": INTS,
    "--etp": INTS, "--local-batch-size": BATCH, "--micro-batch-size": BATCH, "--global-batch-size": BATCH,
    "--seq-len": SEQ, "--pp-schedule": st.sampled_from(["GPipe", "1F1B", "Interleaved1F1B", "Bogus"]),
    "--pp-stages-per-rank": st.sampled_from(["1", "2", "4", "0", "65"]),
    "--ac": st.sampled_from(["none", "full", "selective-op", "layer:2", "layer:0", "bogus"]),
    "--compile": st.sampled_from(["--compile", "--no-compile"]),
    "--float8": st.sampled_from(["--float8", "--no-float8"]),
    "--sequence-parallel": st.sampled_from(["--sequence-parallel", "--no-sequence-parallel"]),
    "--fsdp-reshard-after-forward": st.sampled_from(["default", "always", "never", "bogus"]),
    "--mesh-order": MESH, "--order": _orders(WRAPPERS),
}
BOOL_FLAGS = ("--compile", "--float8", "--sequence-parallel")
MODELS = st.sampled_from(["tiny", "tiny-moe", "llama3-8b", "mixtral-8x7b", "nope"])
PROFILES = st.sampled_from(["h100-sxm-spec", "cpu-gloo-4", "a100-sxm-80gb-spec", "nope"])


VALID = {"--dp-replicate": ["1", "2"], "--dp-shard": ["-1", "1", "2", "4"], "--tp": ["1", "2", "4"],
         "--pp": ["1", "2"], "--cp": ["1", "2"], "--ep": ["1", "2"], "--etp": ["1", "2"],
         "--local-batch-size": ["1", "2", "4", "8"], "--micro-batch-size": ["1", "2"],
         "--global-batch-size": ["8", "16", "32"], "--seq-len": ["256", "1024", "4096"],
         "--pp-schedule": ["GPipe", "1F1B", "Interleaved1F1B"], "--pp-stages-per-rank": ["1", "2"],
         "--ac": ["none", "full", "selective-op", "layer:2"],
         "--fsdp-reshard-after-forward": ["default", "always", "never"]}


@st.composite
def plan_args(draw, gpus=SMALL_GPUS, max_flags=6):
    """(argv tail, {flag: value}) for the shared plan flags; half the cases draw valid values only (few flags),
    so that results, not only refusals, are checked for honouring every flag."""
    valid = draw(st.booleans())
    chosen = draw(st.lists(st.sampled_from(sorted(FLAG_VALUES)), unique=True, max_size=3 if valid else max_flags))
    models = st.sampled_from(["tiny", "tiny-moe", "llama3-8b"]) if valid else MODELS
    profiles = st.sampled_from(["h100-sxm-spec", "cpu-gloo-4"]) if valid else PROFILES
    argv, given_flags = ["--model", draw(models), "--profile", draw(profiles)], {}
    if valid or draw(st.integers(0, 5)):
        g = draw(st.sampled_from(["4", "8", "16"]) if valid else gpus)
        argv += ["--gpus", g]
        given_flags["--gpus"] = g
    for f in chosen:
        v = draw(st.sampled_from(VALID[f]) if valid and f in VALID else FLAG_VALUES[f])
        argv += [v] if f in BOOL_FLAGS else [f, v]
        given_flags[f] = v
    return argv, given_flags


def _as_int(v):
    try:
        return int(v)
    except ValueError:
        return None


def check_plan_honours(plan: dict, flags: dict) -> None:
    """Every given flag shows in the plan (bool flags: the flag itself is the value)."""
    for f, v in flags.items():
        key = f[2:].replace("-", "_")
        if f == "--gpus":
            world = plan["pp"] * plan["dp_replicate"] * plan["dp_shard"] * plan["cp"] * plan["tp"]
            assert world == int(v)
        elif f in BOOL_FLAGS:
            on = not v.startswith("--no-")
            if f == "--sequence-parallel":
                assert plan["sequence_parallel"] == (on and plan["tp"] > 1), (plan, v)
            else:
                assert plan[key] == on, (f, plan)
        elif f == "--dp-shard" and v == "-1":
            continue
        elif f == "--mesh-order":
            listed = [a for a in v.split(",")]
            assert [a for a in plan["mesh_order"] if a in listed] == listed
            assert all(plan[a] == 1 for a in AXES if a not in listed)
        elif f == "--order":
            assert plan["wrapper_order"] == v.split(",")
        elif f == "--fsdp-reshard-after-forward":
            assert plan[key] == v
        elif f == "--pp-stages-per-rank":
            assert plan[key] == int(v), (plan, v)
        elif f == "--pp-schedule":
            assert plan[key] == v
        elif f == "--ac":
            assert plan["ac"] == v
        elif f == "--local-batch-size" and plan["pp"] == 1 and plan["micro_batch_size"] < (_as_int(v) or 0):
            # Megatron's words: without PP a smaller micro batch is gradient accumulation; passes of the micro
            # batch, an optimizer step every local batch
            dp = plan["dp_replicate"] * plan["dp_shard"]
            assert plan["local_batch_size"] == plan["micro_batch_size"], plan
            assert plan["global_batch_size"] % (_as_int(v) * dp) == 0, (plan, v)
        else:
            assert plan[key] == _as_int(v), (f, v, plan[key])


@settings(max_examples=n_cases(250), **SETTINGS)
@given(plan_args())
def test_cli_predict_fuzz(case):
    argv, flags = case
    rc, out, err = call(["predict", *argv, "--json"])
    doc = assert_clean_outcome(rc, out, err)
    if doc is not None:
        check_plan_honours(doc["plan"], flags)
        assert sum(doc["time_breakdown_s"].values()) == pytest.approx(doc["step_time_s"], rel=1e-9)


SEARCH_GPUS = st.sampled_from(["1", "2", "4", "8", "0", "-2", "3", "abc"])
SEARCH_EXTRA = st.one_of(st.just([]), st.sampled_from([
    ["--no-pp"], ["--no-cp"], ["--max-tp", "2"], ["--max-pp", "0"], ["--top", "-1"], ["--ac-modes", "none,full"],
    ["--headroom", "0.5"], ["--headroom", "nan"], ["--explain", "2"], ["--max-plans", "10"]]))


@settings(max_examples=n_cases(40), **SETTINGS)
@given(plan_args(gpus=SEARCH_GPUS, max_flags=5), SEARCH_EXTRA)
def test_cli_search_fuzz(case, extra):
    argv, flags = case
    flags.pop("--gpus", None)
    rc, out, err = call(["search", *argv, "--default-mesh-order", "--top", "3", *extra, "--json"])
    doc = assert_clean_outcome(rc, out, err)
    if doc is None:
        return
    for row in doc["top"] + doc["pareto"]:
        check_plan_honours(row["plan"], flags)
        p = row["plan"]
        if "--no-pp" in extra:
            assert p["pp"] == 1
        if "--max-tp" in extra:
            assert p["tp"] <= 2
        if "--ac-modes" in extra:
            assert p["ac"] in ("none", "full")
        if "--global-batch-size" not in flags:
            assert p["global_batch_size"] == doc["n_gpus"]
        assert p["pp"] * p["dp_replicate"] * p["dp_shard"] * p["cp"] * p["tp"] == doc["n_gpus"]


@settings(max_examples=n_cases(300), **SETTINGS)
@given(st.sampled_from(["run", "trace"]), plan_args(),
       st.sampled_from([[], ["--nnodes", "abc"], ["--nnodes", "1:x"], ["--nnodes", "2:1"], ["--timeout", "nan"],
                        ["--timeout", "-1"], ["--timeout", "1e300"], ["--steps", "0"], ["--rank", "-1"],
                        ["--device", "tpu"], ["--param-dtype", "int8"], ["--out", "/dev/null"]]))
def test_cli_run_and_trace_arguments_fuzz(monkeypatch, command, case, extra):
    """Nothing is launched for bad input; good input reaches the launcher with the plan the flags describe."""
    pytest.importorskip("torch")
    import parsim.executor.launch as launch
    import parsim.executor.trace as trace
    from parsim.results import Measurement

    launched = []

    def record(*args, **kw):
        plan = args[1] if command == "run" else args[1]
        launched.append(plan)
        # (a measurement that succeeded: a failed one ends the command with exit 2 after the launch)
        return Measurement(plan_id=plan.plan_id, kind=command, status="ok", step_times_s=[0.1])

    monkeypatch.setattr(launch, "run_plan", record)
    monkeypatch.setattr(trace, "trace_plan", lambda spec, plan, rank=0: record(spec, plan))
    argv, flags = case
    if command == "trace" and extra and extra[0] in ("--nnodes", "--timeout", "--steps", "--device", "--param-dtype"):
        extra = []
    if command == "run" and extra[:1] == ["--rank"]:
        extra = []
    nproc = ["--nproc-per-node", flags.get("--gpus", "4")] if command == "run" else []
    rc, out, err = call([command, *argv, *nproc, *extra, "--json"])
    doc = assert_clean_outcome(rc, out, err)
    if doc is None:
        assert not launched
        return
    assert len(launched) == 1
    check_plan_honours(launched[0].to_dict(), flags)


# ---- files: model specs, plans and profiles with anything in them --------------------------------------------------
ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                st.text(max_size=6), st.lists(st.integers(-3, 3), max_size=3),
                st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
SMALL_PLAN = Plan(dp_shard=2, tp=2, seq_len=256, local_batch_size=2)


def _mutated(base: dict, keys: list[str], values: list) -> dict:
    d = json.loads(json.dumps(base))
    for k, v in zip(keys, values, strict=False):
        cur, parts = d, k.split(".")
        for p in parts[:-1]:
            cur = cur[p]
        if v == "<delete>":
            cur.pop(parts[-1], None)
        else:
            cur[parts[-1]] = v
    return d


def _leaf_keys(d: dict, prefix="") -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict) and v and k not in ("provenance", "samples"):
            out += _leaf_keys(v, f"{prefix}{k}.")
        else:
            out.append(prefix + k)
    return out


def _check_prediction_or_refusal(make) -> None:
    try:
        spec, plan, hw = make()
        p = predict(spec, plan, hw)
    except ParsimError as e:
        assert str(e) and "\n" not in str(e).strip()
        event("refused")
        return
    event("predicted")
    _finite_numbers(p.to_dict())


MODEL_BASE = PRESETS["tiny-moe"].to_dict()
MODEL_KEYS = _leaf_keys(MODEL_BASE)


@settings(max_examples=n_cases(1500), **SETTINGS)
@given(st.lists(st.sampled_from(MODEL_KEYS), min_size=1, max_size=3, unique=True),
       st.lists(st.one_of(ANY, st.sampled_from([0, 1, 2, 3, 7, 16, 2**20, 2**30, "<delete>"])), min_size=3, max_size=3))
def test_model_spec_files_fuzz(keys, values):
    _check_prediction_or_refusal(lambda: (ModelSpec.from_dict(_mutated(MODEL_BASE, keys, values)), SMALL_PLAN,
                                          load_profile("h100-sxm-spec")))


PLAN_BASE = SMALL_PLAN.to_dict()


@settings(max_examples=n_cases(1500), **SETTINGS)
@given(st.lists(st.sampled_from(sorted(PLAN_BASE)), min_size=1, max_size=3, unique=True),
       st.lists(st.one_of(ANY, st.sampled_from([0, 1, 2, 4, 8, 2**21, "GPipe", "full", "never", "<delete>",
                                                list(reversed(AXES)), ["tp"]])), min_size=3, max_size=3))
def test_plan_files_fuzz(keys, values):
    def make():
        plan = Plan.from_dict(_mutated(PLAN_BASE, keys, values))
        validate_plan(plan, PRESETS["tiny"])
        return PRESETS["tiny"], plan, load_profile("h100-sxm-spec")

    _check_prediction_or_refusal(make)


PROFILE_BASE = load_profile("cpu-gloo-4").to_dict()
PROFILE_KEYS = _leaf_keys(PROFILE_BASE)


@settings(max_examples=n_cases(1500), **SETTINGS)
@given(st.lists(st.sampled_from(PROFILE_KEYS), min_size=1, max_size=3, unique=True),
       st.lists(st.one_of(ANY, st.sampled_from([0, -1, 1.5, 1e-300, 1e300, 3, "<delete>"])), min_size=3, max_size=3))
def test_profile_files_fuzz(keys, values):
    _check_prediction_or_refusal(lambda: (PRESETS["tiny"], SMALL_PLAN,
                                          HardwareProfile.from_dict(_mutated(PROFILE_BASE, keys, values))))
