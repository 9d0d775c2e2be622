"""Property-based tests of what the command line reads and writes (hypothesis, derandomized): every input file
(plan, model config, profile, published CSV, a validate folder's rows), every output path, integer flags and flags
that need another flag. Every case ends as a clean result or one ``error:`` line with exit 2, never a traceback or a
hang; no file that existed is changed by a refused command, no two outputs clobber each other or an input, and no
temporary file is left beside a target.

Case counts in CI (``PARSIM_FUZZ_SCALE`` multiplies them, ``bench/fuzz_cli.py``): input files 400, output paths
200, integer flags 200, dependent flags 60.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_fuzz import assert_clean_outcome, call, n_cases

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

PLAN_OK = {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "seq_len": 256, "local_batch_size": 2}


def _contents(kind: str, variant: int) -> bytes | None:
    """What an input file holds: valid JSON of the right kind, or one of the shapes that broke readers (None: the
    path is something else than a regular file)."""
    good = {"plan": PLAN_OK, "rows": [], "profile": {"name": "p"}, "model": {"model_type": "llama"}}[kind]
    shapes = [
        json.dumps(good).encode(),
        b"[" * 100_000,  # nested too deeply for a recursive parser
        b'{"pp": ' + b"9" * 5001 + b"}",  # an integer longer than Python converts
        b"[1]", b"[]", b"[{}]", b"{}", b"null", b"", b"\xff\xfe\x00garbage",
        json.dumps([{"tier": "measured", "model": "tiny", "plan_id": "x", "status": "ok",
                     "measured_step_s": "fast"}]).encode(),
        b'[{"tier": "measured", "model": "tiny", "plan_id": "x", "status": "ok", "predicted_step_s": Infinity}]',
        json.dumps({**PLAN_OK, "tp": "two"}).encode(), json.dumps({**PLAN_OK, "ep": 1e308}).encode(),
        b'{"a": ' + b"[" * 70 + b"1" + b"]" * 70 + b"}",  # deeper than any parsim file, shallower than a bomb
        None,  # a FIFO
    ]
    return shapes[variant % len(shapes)]


def _write_input(tmp: Path, name: str, data: bytes | None) -> Path:
    p = tmp / name
    if data is None:
        os.mkfifo(p)
    else:
        p.write_bytes(data)
    return p


def _published(tmp: Path, variant: int) -> Path:
    """A published CSV: the development rows' header with one row of drawn values."""
    header = (Path(__file__).resolve().parent.parent / "bench" / "published" / "dev.csv").read_text().splitlines()
    cols = header[0].split(",")
    first = header[1].split(",")
    values = ["inf", "-1", "1e400", "abc", "", "0", "4_0", "nan"]
    row = [values[(variant + i) % len(values)] if c in ("gpus", "ep", "tp", "seq_len", "local_batch_size")
           else v for i, (c, v) in enumerate(zip(cols, first, strict=False))]
    p = tmp / "published.csv"
    p.write_text(header[0] + "\n" + ",".join(row) + "\n")
    return p


def _spec_dict(name: str) -> dict:
    import dataclasses

    from parsim.spec import PRESETS

    return dataclasses.asdict(PRESETS[name])


def _no_leftovers(tmp: Path, before: set) -> None:
    left = [p.name for p in tmp.rglob(".*") if p.name not in before and p.is_file()]
    assert not left, left


@settings(max_examples=n_cases(400), **SETTINGS)
@given(st.sampled_from(["plan", "model", "profile", "rows", "calibrate", "published", "long-name"]),
       st.integers(0, 1000))
def test_input_files_fuzz(tmp_path_factory, kind, variant):
    """Whatever an input file holds (or whatever the path is), one clean outcome."""
    tmp = tmp_path_factory.mktemp("in")
    if kind == "plan":
        p = _write_input(tmp, "plan.json", _contents("plan", variant))
        argv = ["predict", "--model", "tiny", "--plan", str(p), "--json"]
    elif kind == "model":
        p = _write_input(tmp, "config.json", _contents("model", variant))
        argv = ["predict", "--model", str(p), "--gpus", "2", "--dp-shard", "2", "--json"]
    elif kind == "profile":
        p = _write_input(tmp, "prof.json", _contents("profile", variant))
        argv = ["predict", "--model", "tiny", "--gpus", "2", "--dp-shard", "2", "--profile", str(p), "--json"]
    elif kind in ("rows", "calibrate"):
        (tmp / "d").mkdir()
        _write_input(tmp / "d", "rows.json", _contents("rows", variant))
        argv = ["report", str(tmp / "d"), "--json"] if kind == "rows" else ["calibrate", str(tmp / "d"), "--json"]
    elif kind == "published":
        argv = ["validate", "--published", str(_published(tmp, variant)), "--out", str(tmp / "v"), "--json"]
    else:
        flag = ["--model", "--plan", "--profile"][variant % 3]
        base = ["predict", "--model", "tiny", "--gpus", "2", "--dp-shard", "2"]
        argv = [*base, flag, str(tmp / ("x" * (200 + variant % 200))), "--json"]
    rc, out, err = call(argv)
    assert_clean_outcome(rc, out, err)


OUTPUT_FLAGS = ("--emit-plan", "--emit-torchtitan", "--emit-megatron", "--csv")


@settings(max_examples=n_cases(200), **SETTINGS)
@given(st.lists(st.sampled_from(OUTPUT_FLAGS), min_size=1, max_size=3, unique=True),
       st.lists(st.sampled_from(["a.json", "a.json", "b.py", "dir/", "existing", "sub", "missing/x.json",
                                 "/proc/x.json", "/dev/null", "LONG", "input"]), min_size=3, max_size=3))
def test_output_paths_fuzz(tmp_path_factory, flags, names):
    """search's outputs: each a file of its own, none an input; refused before any work with nothing changed, or
    written without a temporary file left beside it."""
    tmp = tmp_path_factory.mktemp("out")
    (tmp / "sub").mkdir()
    (tmp / "existing").write_text("keep")
    (tmp / "input").write_text(json.dumps(_spec_dict("tiny")))  # the model config the search reads
    before = {p.name for p in tmp.rglob(".*")}
    stamp = {p: p.read_text() for p in (tmp / "existing", tmp / "input")}

    def path(n: str) -> str:
        if n == "LONG":
            return str(tmp / ("n" * 300))
        return n if n.startswith("/") else str(tmp / n)

    argv = ["search", "--model", str(tmp / "input"), "--gpus", "2", "--global-batch-size", "4", "--seq-len", "256",
            "--top", "2"]
    chosen = {f: path(n) for f, n in zip(flags, names, strict=False)}
    for f, p in chosen.items():
        argv += [f, p]
    if "--emit-torchtitan" in chosen and names[-1] == "b.py":
        argv += ["--torchtitan-format", "toml"]
    rc, out, err = call([*argv, "--json"])
    assert_clean_outcome(rc, out, err)
    paths = list(chosen.values())
    if rc == 0:
        assert len({os.path.realpath(p) for p in paths}) == len(paths)  # (same file twice is refused)
        assert stamp[tmp / "input"] == (tmp / "input").read_text()
    else:
        for p, text in stamp.items():
            if str(p) not in paths:
                assert p.read_text() == text
    _no_leftovers(tmp, before)


@settings(max_examples=n_cases(200), **SETTINGS)
@given(st.sampled_from(["--gpus", "--dp-shard", "--tp", "--seq-len", "--local-batch-size", "--top"]),
       st.sampled_from(["4_0", "+2", "2.0", "0x10", "1e3", " 2", "2 ", "-0", "٣", "", "2" * 30, "4", "2"]))
def test_integer_flags_are_digits_only(flag, value):
    """An integer flag is its digits: anything else is refused in one line, never read as another number."""
    argv = ["search" if flag == "--top" else "predict", "--model", "tiny", "--gpus", "4", "--dp-shard", "-1",
            "--global-batch-size", "8", "--seq-len", "256", "--json"]
    if flag in argv:
        i = argv.index(flag)
        argv[i + 1] = value
    else:
        argv += [flag, value]
    rc, out, err = call(argv)
    doc = assert_clean_outcome(rc, out, err)
    digits = value.strip()
    if doc is not None:
        assert digits.lstrip("-").isascii() and digits.lstrip("-").isdigit(), (flag, value)


DEPENDENT = [(["--execute-out", "x.json"], "--execute"), (["--torchtitan-format", "toml"], "--emit-torchtitan"),
             (["--measure-budget-flops", "1e9"], "--measure"), (["--wide"], "a table")]


@settings(max_examples=n_cases(60), **SETTINGS)
@given(st.sampled_from(DEPENDENT), st.booleans())
def test_flags_that_need_another_are_refused_alone(tmp_path_factory, case, as_json):
    """A flag that means something only beside another is refused without it (not ignored in silence)."""
    extra, needs = case
    tmp = tmp_path_factory.mktemp("dep")
    extra = [str(tmp / e) if e.endswith(".json") else e for e in extra]
    argv = ["search", "--model", "tiny", "--gpus", "2", "--global-batch-size", "4", "--seq-len", "256", *extra]
    if as_json or needs == "a table":
        argv.append("--json")
    rc, out, err = call(argv)
    assert rc == 2 and needs in err, err
    assert not any(p.exists() for p in tmp.iterdir())


def test_the_cases_the_independent_fuzz_found(tmp_path):
    """The instances the issue lists, one by one."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    big = tmp_path / "big.json"
    big.write_text('{"pp": ' + "9" * 5001 + "}")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    rows = tmp_path / "r"
    rows.mkdir()
    (rows / "rows.json").write_text("[1]")
    same = str(tmp_path / "x.json")
    cases = [
        (["predict", "--plan", str(deep)], "nested"), (["predict", "--model", str(deep), "--gpus", "1"], "nested"),
        (["predict", "--model", "tiny", "--plan", str(big)], "digits"),
        (["predict", "--model", "tiny", "--plan", str(fifo)], "not a regular file"),
        (["predict", "--model", "x" * 300, "--gpus", "1"], "unknown model"),
        (["report", str(rows)], "row 0"), (["calibrate", str(rows)], "row 0"),
        (["report", str(rows), "--csv", str(rows / "rows.json")], "overwrite the input"),
        (["search", "--model", "tiny", "--gpus", "2", "--emit-plan", same, "--csv", same], "both write"),
        (["search", "--model", "tiny", "--gpus", "2", "--emit-megatron", str(tmp_path / "out.sh") + "/"],
         "folder"),
        (["predict", "--model", "tiny", "--gpus", "4", "--dp-shard", "4_0"], "whole number"),
        (["predict", "--model", "tiny", "--gpus", "+4", "--dp-shard", "4"], "whole number"),
        (["validate", "--published", "bench/published/dev.csv", "--out", str(tmp_path / "v"), "--rounds", "3"],
         "measured tier"),
        (["validate", "--out", str(tmp_path / "v"), "--uncalibrated"], "--published"),
        (["report", str(rows), "--plotly-js", "cdn"], "--html"),
    ]
    for argv, words in cases:
        rc, out, err = call(argv)
        assert rc == 2 and words in err and "Traceback" not in err, (argv, err)
    assert (rows / "rows.json").read_text() == "[1]"


def test_hf_config_refusals_name_the_config_fields(tmp_path):
    """A Hugging Face config refused names its own fields, unmangled."""
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": -3, "num_hidden_layers": 0,
           "intermediate_size": 100, "vocab_size": 1000}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    rc, out, err = call(["predict", "--model", str(p), "--gpus", "1"])
    assert rc == 2 and ("num_hidden_layers must" in err or "num_attention_heads must" in err), err
    assert "num_hiddenum" not in err and "num_attentionum" not in err


@pytest.mark.parametrize("flag", ["--global-batch-size", "--micro-batch-size"])
def test_help_says_what_a_left_out_batch_size_means(flag):
    """The help of the batch sizes says what leaving them out means (0 is refused, so the help does not offer it)."""
    rc, out, err = call(["predict", "--help"])
    assert rc == 0
    text = " ".join(out.split())
    assert "(0:" not in text
