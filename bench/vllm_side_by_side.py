"""Our engine against vLLM on the same tiny checkpoint (logic: deploy/bench/vllm_side_by_side.py)."""

import sys

from deploy.bench.vllm_side_by_side import main

if __name__ == "__main__":
    sys.exit(main())
