"""The command line of ``tests/differential.py``: the tester lives beside the tests that run its CI slice, and
its docstring says what it checks and how to run it.

    python bench/differential.py --help
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from differential import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
