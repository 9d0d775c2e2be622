"""``python -m parsim``: the command-line interface."""
from parsim.cli.main import main

main()
