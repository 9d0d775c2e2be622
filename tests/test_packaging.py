"""What a user installs: the sdist and the wheel built from it, installed into a fresh virtual environment with no
torch and no checkout on the path, then the README's first command, ``python -m parsim`` and the torch commands."""

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(cmd, cwd, env=None, timeout=600):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, parsim script, wheel path, env) of a fresh venv holding the wheel built from the sdist."""
    base = tmp_path_factory.mktemp("pkg")
    r = _run([sys.executable, "-m", "build", "--outdir", base / "dist", REPO], cwd=base)
    if r.returncode and "No module named build" in r.stderr:
        pytest.skip("the `build` package is not installed (pip install build)")
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next((base / "dist").glob("parsim-*.whl"))
    venv.create(base / "venv", with_pip=True)
    py = base / "venv" / "bin" / "python"
    r = _run([py, "-m", "pip", "install", "-q", wheel], cwd=base)
    if r.returncode:
        pytest.skip(f"cannot install the wheel's dependencies from the package registry: {r.stderr[-300:]}")
    env = {"PATH": f"{base / 'venv' / 'bin'}:/usr/bin:/bin", "HOME": str(base / "home"), "LANG": "C.UTF-8"}
    return py, base / "venv" / "bin" / "parsim", wheel, env, base


@pytest.mark.slow
def test_the_wheel_carries_the_profiles_and_only_the_parsim_package(installed):
    _, _, wheel, _, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"parsim"}, tops  # no top-level `cli`
    assert "parsim/profiles/h100-sxm-spec-cal.json" in names and "parsim/profiles/orders.json" in names
    assert "parsim/cli/main.py" in names and "parsim/__main__.py" in names
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    for field in ("License-Expression: BSD-3-Clause", "Author: ", "Requires-Python: ", "Classifier: "):
        assert field in meta, field


@pytest.mark.slow
def test_readme_command_1_predict_and_python_m_parsim_from_the_installed_wheel(installed):
    py, parsim, _, env, base = installed
    r = _run([parsim, "search", "--model", "llama3-8b", "--gpus", "64", "--top", "3", "--json"], cwd=base, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["profile"] == "h100-sxm-spec-cal" and len(doc["top"]) == 3
    r = _run([py, "-m", "parsim", "predict", "--model", "llama3-8b", "--gpus", "8", "--json"], cwd=base, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["fits"] is True
    r = _run([py, "-c", "import parsim, importlib.util as u; print(parsim.__file__, u.find_spec('cli'), "
              "u.find_spec('torch'))"], cwd=base, env=env)
    assert "site-packages" in r.stdout and r.stdout.strip().endswith("None None"), r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args", [["trace", "--model", "tiny", "--gpus", "2"],
                                  ["run", "--model", "tiny", "--gpus", "2", "--nproc-per-node", "2"],
                                  ["profile", "--nproc-per-node", "2", "--out", "x"],
                                  ["search", "--model", "tiny", "--gpus", "2", "--execute", "1"]])
def test_torch_commands_without_torch_say_so_in_one_line_with_exit_2(installed, args):
    _, parsim, _, env, base = installed
    r = _run([parsim, *args], cwd=base, env=env)
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-500:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs PyTorch" in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_profiles_written_by_name_go_to_the_users_folder_not_the_package(installed):
    py, _, _, env, base = installed
    code = ("from parsim.hardware import profile_write_dir, profile_dirs, PACKAGED_PROFILES_DIR as P; "
            "print(profile_write_dir()); print(P)")
    r = _run([py, "-c", code], cwd=base, env=env)
    write_dir, packaged = r.stdout.split()
    assert write_dir == str(base / "home" / ".local" / "share" / "parsim" / "profiles")
    assert "site-packages" in packaged
    r = _run([py, "-c", code], cwd=base, env={**env, "PARSIM_PROFILES_DIR": str(base / "mine")})
    assert r.stdout.split()[0] == str(base / "mine")
    assert os.path.isdir(packaged)


def test_dockerfile_pins_the_ci_torch_and_runs_as_a_user():
    """No docker daemon here to build it: the Dockerfile is checked against CI's pin and its own promises."""
    import re

    ci_pin = re.search(r"torch==([\d.]+)", (REPO / ".ci" / "run").read_text()).group(1)
    docker = (REPO / "Dockerfile").read_text()
    assert re.search(r"ARG TORCH_VERSION=([\d.]+)", docker).group(1) == ci_pin
    users = re.findall(r"^USER (\S+)", docker, re.M)
    assert users and users[-1] not in ("root", "0")
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", "tests", "bench", "dist", "*.egg-info"} <= set(ignored)
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", docker, re.M):
        for path in src.split():
            assert (REPO / path).exists(), path
