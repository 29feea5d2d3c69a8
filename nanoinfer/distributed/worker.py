"""`python -m nanoinfer.distributed.worker RANK WORLD INIT_METHOD DEVICE THREADS`: a local tensor-parallel
worker, as TensorParallelExecutor starts it (a module nothing imports, so running it as
__main__ loads it once)."""
import sys

from .executor import worker_main

if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
