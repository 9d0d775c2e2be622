"""parsim command-line interface (typer)."""
