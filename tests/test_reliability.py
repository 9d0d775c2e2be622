"""Reliability: child process trees always end, outputs never clobber, bad paths are refused before work starts."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from parsim.cli.main import main
from parsim.errors import ParsimError
from parsim.jsonio import atomic_write_json, atomic_write_text, check_output_path
from parsim.procs import ProcessTree, tagged_pids

# a command that leaves a grandchild in a session of its own, as torch elastic does with its workers
WORKER = "import time; print('worker up', flush=True); time.sleep(600)"
DETACHED = ("import subprocess, sys, time; "
            f"subprocess.Popen([sys.executable, '-c', {WORKER!r}], start_new_session=True); time.sleep(600)")


def _wait_until(cond, limit_s: float = 30.0) -> bool:
    """Poll ``cond`` (liveness, not speed: the limit only keeps a broken build from hanging the suite)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_process_tree_ends_a_detached_grandchild():
    with ProcessTree([sys.executable, "-c", DETACHED]) as tree:
        assert _wait_until(lambda: "worker up" in tree.output())
        assert len(tree.alive()) == 2
        assert tree.wait(0.2) is None  # still running: a timeout
        tree.end(grace_s=1.0)
        assert tree.alive() == set()
        assert tree.proc.returncode is not None  # reaped, no zombie
    assert tagged_pids(tree.tag) == set()
    assert not os.path.exists(tree.log_path)


def test_process_tree_ends_everything_on_keyboard_interrupt():
    with pytest.raises(KeyboardInterrupt):
        with ProcessTree([sys.executable, "-c", DETACHED]) as tree:
            assert _wait_until(lambda: "worker up" in tree.output())
            raise KeyboardInterrupt
    assert tagged_pids(tree.tag) == set()


def test_children_die_with_a_killed_parent():
    """parsim itself SIGKILLed (no cleanup can run): PR_SET_PDEATHSIG takes torchrun and its workers with it."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    child = ("from parsim.procs import die_with_parent; die_with_parent(); import time; "
             "print('child up', flush=True); time.sleep(600)")
    parent = ("import subprocess, sys, time; from parsim.procs import ProcessTree; "
              f"t = ProcessTree([sys.executable, '-c', {child!r}]); print(t.tag, flush=True); time.sleep(600)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, env=env)
    tag = p.stdout.readline().strip()
    assert _wait_until(lambda: len(tagged_pids(tag)) == 1)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert _wait_until(lambda: tagged_pids(tag) == set())


# ---- outputs -------------------------------------------------------------------------------------------------
def test_special_files_and_folders_are_refused_and_untouched(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target in (fifo, tmp_path, "/dev/null"):
        with pytest.raises(ParsimError, match="not a regular file"):
            atomic_write_text(target, "x")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert sorted(os.listdir(tmp_path)) == ["fifo"]  # no temporary file left behind


def test_missing_parent_refused_unless_asked(tmp_path):
    with pytest.raises(ParsimError, match="does not exist"):
        atomic_write_text(tmp_path / "a" / "b" / "f.json", "x")
    assert not (tmp_path / "a").exists()
    atomic_write_text(tmp_path / "a" / "b" / "f.json", "x", make_parents=True)
    assert (tmp_path / "a" / "b" / "f.json").read_text() == "x"


def test_written_files_follow_the_umask_or_keep_their_mode(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "new.txt", "x")
        assert stat.S_IMODE(os.stat(tmp_path / "new.txt").st_mode) == 0o644
        os.umask(0o077)
        atomic_write_text(tmp_path / "private.txt", "x")
        assert stat.S_IMODE(os.stat(tmp_path / "private.txt").st_mode) == 0o600
        os.chmod(tmp_path / "new.txt", 0o640)
        atomic_write_json(tmp_path / "new.txt", {"a": 1})
        assert stat.S_IMODE(os.stat(tmp_path / "new.txt").st_mode) == 0o640
    finally:
        os.umask(old)


def test_a_symlink_target_is_replaced_not_the_link(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    atomic_write_json(link, {"a": 1})
    assert link.is_symlink() and json.loads(real.read_text()) == {"a": 1}
    assert check_output_path(link) == real.resolve()


def test_json_never_holds_nan(tmp_path):
    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "x.json", {"a": float("nan")})
    assert not (tmp_path / "x.json").exists()


def _cli(argv, capsys):
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_search_refuses_bad_outputs_before_searching(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for flag in ("--csv", "--emit-plan", "--emit-torchtitan"):
        rc, out, err = _cli(["search", "--model", "tiny", "--gpus", "4", flag, str(fifo)], capsys)
        assert rc == 2 and "not a regular file" in err and out == ""
        rc, out, err = _cli(["search", "--model", "tiny", "--gpus", "4", flag, str(tmp_path / "no" / "f")], capsys)
        assert rc == 2 and "does not exist" in err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and sorted(os.listdir(tmp_path)) == ["fifo"]


def test_search_csv_is_written_with_user_names(tmp_path, capsys):
    rc, _, err = _cli(["search", "--model", "tiny", "--gpus", "4", "--csv", str(tmp_path / "s.csv"), "--json"],
                      capsys)
    assert rc == 0, err
    header = (tmp_path / "s.csv").read_text().splitlines()[0].split(",")
    assert "fsdp_reshard_after_forward" in header and "wrapper_order" in header


def test_profile_rejects_bad_input_before_measuring(tmp_path, capsys):
    rc, _, err = _cli(["profile", "--nproc-per-node", "2", "--out", "fz", "--out-dir", str(tmp_path), "--model",
                       "nope"], capsys)
    assert rc == 2 and "unknown model" in err
    rc, _, err = _cli(["profile", "--nproc-per-node", "2", "--out", str(tmp_path / "x" / "fz"), "--ops", "bogus"],
                      capsys)
    assert rc == 2 and "--ops" in err
    assert os.listdir(tmp_path) == []  # no .partial left behind


def test_profile_resume_refuses_other_ranks(tmp_path, capsys):
    partial = tmp_path / ".fz.partial"
    partial.mkdir()
    (partial / "args.json").write_text(json.dumps({"nproc_per_node": 4, "model": "tiny", "seq_len": 512,
                                                   "device": None}))
    rc, _, err = _cli(["profile", "--nproc-per-node", "2", "--out", "fz", "--out-dir", str(tmp_path)], capsys)
    assert rc == 2 and "--resume to continue" in err and "--restart" in err
    rc, _, err = _cli(["profile", "--nproc-per-node", "2", "--out", "fz", "--out-dir", str(tmp_path), "--resume"],
                      capsys)
    assert rc == 2 and "nproc_per_node was 4, now 2" in err


def test_usage_errors_are_one_line(capsys):
    for argv in (["predict", "--gpus", "abc"], ["predict", "--bogus"], ["search", "--top", "x"]):
        rc, out, err = _cli(argv, capsys)
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and err.startswith("error: ")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_cli_run_leaves_no_process(sig):
    """Ctrl-C (or SIGTERM) on `parsim run` while its workers train: torchrun and every worker end, exit 130."""
    pytest.importorskip("torch")
    import uuid

    mark = uuid.uuid4().hex
    env = dict(os.environ, PARSIM_TEST_MARK=mark, PYTHONPATH=os.pathsep.join(sys.path))
    # Ctrl-C as a terminal delivers it to a foreground process: SIGINT at its default disposition in the child,
    # whatever this process inherited (a test run started as a background job of a non-interactive shell, e.g.
    # `bash -c 'pytest &'`, has SIGINT ignored, and a Python started so keeps ignoring it, as nohup intends)
    p = subprocess.Popen([sys.executable, "-m", "parsim", "run", "--model", "tiny", "--gpus", "2", "--dp-shard", "2",
                          "--seq-len", "64", "--nproc-per-node", "2", "--steps", "100000", "--timeout", "600"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert _wait_until(lambda: len(tagged_pids(mark, "PARSIM_TEST_MARK")) >= 3, 120)  # parsim, torchrun, workers
    p.send_signal(sig)
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"parsim run did not end within 120 s of signal {sig!r}; its output:\n{out[-3000:]}")
    assert p.returncode == 130, out[-2000:]
    assert "interrupted" in out and "Traceback" not in out
    assert _wait_until(lambda: tagged_pids(mark, "PARSIM_TEST_MARK") == set(), 30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signal_during_search_csv_leaves_no_file(tmp_path, sig):
    """SIGTERM (or Ctrl-C) while `parsim search --csv` streams every plan: exit 130, neither the CSV nor its
    temporary file is left (the CSV is written beside its target and renamed only when complete)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = tmp_path / "all.csv"
    p = subprocess.Popen([sys.executable, "-m", "parsim", "search", "--model", "llama3-8b", "--gpus", "64",
                          "--global-batch-size", "256", "--seq-len", "8192", "--csv", str(out), "--max-plans", "0"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert _wait_until(lambda: any(f.name.startswith(".all.csv.") for f in tmp_path.iterdir()), 120)
    p.send_signal(sig)
    try:
        text, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("parsim search did not end within 120 s of the signal")
    assert p.returncode == 130 and "Traceback" not in text, text[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_before_the_discarding_try_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The interrupt lands after the temporary file exists but before the ``try`` that would discard it (the window
    a signal sent as soon as the file appears can hit): the CLI's exit removes it, exit 130, the target absent."""
    import parsim.search_job as job
    from parsim.jsonio import AtomicFile

    def interrupted(spec, hw, gpus, space, top, table_path, progress):
        AtomicFile(table_path)  # created, never committed nor discarded
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "search_to_table", interrupted)
    out = tmp_path / "all.csv"
    code = main(["search", "--model", "llama3-8b", "--gpus", "8", "--csv", str(out)])
    assert code == 130 and list(tmp_path.iterdir()) == []


def test_a_refused_rename_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The target cannot be replaced (immutable, or a read-only place): one ParsimError line, the temporary file
    beside it removed."""
    target = tmp_path / "x.json"

    def refuse(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(ParsimError, match="cannot write"):
        atomic_write_json(target, {"a": 1})
    assert list(tmp_path.iterdir()) == []
