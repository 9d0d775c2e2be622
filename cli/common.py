"""What the CLI's modules share (``main``, ``views``, ``loop`` import it; it imports none of them): the profile to
predict with on this machine, and JSON on stdout."""

from __future__ import annotations

import json
import sys


def profile_for_this_machine(name: str):
    """Load a profile; a measured CPU profile from another machine gets one warning line on stderr."""
    from parsim.hardware import load_profile
    from parsim.machine import warning

    hw = load_profile(name)
    w = warning(hw)
    if w:
        print(w, file=sys.stderr)
    return hw


def profile_measured_here(name: str, nproc: int | None = None):
    """The profile to predict runs on this machine with: ``name`` when it describes this machine (or is not a
    measured CPU profile: spec sheets and GPU profiles describe hardware elsewhere); otherwise this machine's own,
    ``<name>-<machine tag>``, loaded when an earlier call measured it, else measured now with ``parsim profile``
    defaults (about a minute on 2 cores) and kept beside the others. ``validate --model`` and ``search --execute``
    use it: a prediction set beside a measurement must describe the machine that measured."""
    from parsim.errors import ParsimError
    from parsim.hardware import load_profile
    from parsim.machine import machine_tag, warning

    hw = load_profile(name)
    if not warning(hw):
        return hw
    own = f"{hw.name}-{machine_tag()}"
    try:
        mine = load_profile(own)
        if not warning(mine):
            print(f"profile {hw.name} was measured on another machine: using this machine's {own}", file=sys.stderr)
            return mine
    except ParsimError:
        pass
    n = nproc or int(hw.provenance.get("device_count") or 2)
    print(f"profile {hw.name} was measured on another machine ({warning(hw)}); measuring this one first: "
          f"parsim profile --nproc-per-node {n} --out {own}", file=sys.stderr)
    from parsim.profiler.run import profile as _profile

    return _profile(own, n, log=lambda m: print(m, file=sys.stderr))


def emit_json(obj) -> None:
    from parsim.jsonio import _json_default

    sys.stdout.write(json.dumps(obj, indent=1, default=_json_default, allow_nan=False) + "\n")
