"""The command line of the framework checks: ``SCRIPT FILE WORLD_SIZE [FILE WORLD_SIZE ...]``, one JSON line per
file: what the framework settled on, or ``{"error": ...}`` with the framework's own refusal."""

import json
import sys


def run_all(check) -> None:
    argv = sys.argv
    for i in range(1, len(argv), 2):
        try:
            res = check(argv[i], int(argv[i + 1]))
        except BaseException as e:  # noqa: BLE001 - the framework's refusal (an assert, argparse's exit) is the result
            res = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({"path": argv[i], **res}, default=str), flush=True)
