"""The one exception type that means "the user gave bad input": the CLI prints its message on one line and exits 2."""


class ParsimError(ValueError):
    """Invalid model, plan, profile or file; the message says what and shows the arithmetic."""
