"""`python -m nanoinfer ...`: the command line (also what `torchrun ... -m nanoinfer serve` runs on every rank)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
