"""The one exception type that means "the user gave bad input": the CLI prints its message on one line and exits 2;
and the one range check that raises it for numbers."""

import math
import numbers


class ParsimError(ValueError):
    """Invalid model, plan, profile or file; the message says what and shows the arithmetic. Always one line: a
    value from a file interpolated as it is (a string holding a line break) is shown with its breaks escaped, as
    ``repr`` would show them (found by the profile-file fuzz: a ``schema_version`` of ``"\\n"``)."""

    def __init__(self, message: object = "", *args: object):
        text = str(message).replace("\r", "\\r").replace("\n", "\\n")
        super().__init__(text, *args)


class ParsimWarning(UserWarning):
    """Something parsim reads but does not model (printed by the CLI as one ``warning:`` line on stderr)."""


def check_number(where: str, v, low: float = 0.0, high: float = math.inf, *, low_open: bool = False,
                 integer: bool = False) -> None:
    """One ParsimError line unless ``v`` is a finite number (an int when ``integer``) within [low, high]
    ((low, high] when ``low_open``): flags, plan files and profiles can hold anything."""
    ok = isinstance(v, (numbers.Integral, float)) and not isinstance(v, bool) and math.isfinite(v)
    if integer:
        ok = ok and isinstance(v, numbers.Integral)
    ok = ok and (v > low if low_open else v >= low) and v <= high
    if not ok:
        kind = "an integer" if integer else "a finite number"
        lo = f"({low}" if low_open else f"[{low}"
        raise ParsimError(f"{where} must be {kind} in {lo}, {high}], got {v!r}")
