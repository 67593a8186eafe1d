"""``python -m micro_vllm``: the same command line as ``micro-vllm``."""

import sys

from micro_vllm.cli import main

sys.exit(main())
