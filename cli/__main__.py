"""``python -m parsim.cli``: the command-line interface (``python -m parsim`` is the same)."""
from .main import main

main()
