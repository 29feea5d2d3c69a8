"""`python -m nanoinfer.bench latency|throughput|loop ...`"""
import sys

from .cli import main

sys.exit(main())
