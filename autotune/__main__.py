"""``python -m autotune``: the same command line as ``autotune``."""

from autotune.cli import main

main()
