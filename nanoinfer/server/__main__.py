"""`python -m nanoinfer.server --model PATH [--port 8000] ...`: the same as `nanoinfer serve`."""
import sys

from .cli import main

sys.exit(main())
