"""Fuzz the command line with the property tests' strategies, scaled up, and report what happened.

    python bench/fuzz_cli.py --scale 2   # the CLI cases of tests/test_fuzz.py and tests/test_fuzz_io.py, x2

Every case must end as a result with finite numbers that honours every flag given, or as one 'error:' line with
exit code 2 (the assertions of tests/test_fuzz.py); this script adds the counts, exit codes and the slowest case
(a hang would show there), and checks that no process tagged by a run survives.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=2)
    args = ap.parse_args()
    os.environ["PARSIM_FUZZ_SCALE"] = str(args.scale)
    import pytest

    import tests.test_fuzz as tf

    stats = collections.Counter()
    slowest = [0.0, None]
    orig = tf.call

    def timed(argv):
        t = time.perf_counter()
        rc, out, err = orig(argv)
        dt = time.perf_counter() - t
        stats[(argv[0], rc)] += 1
        if dt > slowest[0]:
            slowest[:] = [dt, argv]
        return rc, out, err

    tf.call = timed
    import tempfile

    import tests.test_fuzz_io as tio

    tio.call = timed

    class Folders:  # (pytest's tmp_path_factory, for the file and path cases)
        def mktemp(self, name: str) -> Path:
            return Path(tempfile.mkdtemp(prefix=f"parsim-fuzz-{name}-"))

    t0 = time.perf_counter()
    tf.test_cli_predict_fuzz()
    tf.test_cli_search_fuzz()
    with pytest.MonkeyPatch.context() as mp:
        tf.test_cli_run_and_trace_arguments_fuzz(mp)
    tio.test_input_files_fuzz(tmp_path_factory=Folders())
    tio.test_output_paths_fuzz(tmp_path_factory=Folders())
    tio.test_integer_flags_are_digits_only()
    tio.test_flags_that_need_another_are_refused_alone(tmp_path_factory=Folders())
    wall = time.perf_counter() - t0
    total = sum(stats.values())
    print(f"{total:,} CLI cases in {wall:.0f} s, all assertions held (0 tracebacks, 0 non-finite numbers, "
          "0 ignored flags, 0 clobbered or left-over files)")
    for (cmd, rc), n in sorted(stats.items()):
        print(f"  {cmd:8s} exit {rc}: {n:,}")
    print(f"slowest case {slowest[0]:.2f} s: parsim {' '.join(slowest[1])}")
    left = os.popen("ps -eo pid,args | grep -E 'parsim.executor.worker|torch.distributed.run' | grep -v grep").read()
    print("processes of runs left:", left.strip() or "none")


if __name__ == "__main__":
    main()
