import sys

from micro_vllm.cli import main

sys.exit(main())
