"""Where vLLM users import ``FlexibleArgumentParser`` from (``vllm.utils``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's argument parser: an option may be spelled with underscores as well as dashes
    (``--max_model_len 512`` is ``--max-model-len 512``), so that flags written for vLLM parse here.
    vLLM's YAML ``--config`` file and its dotted JSON options are not supported."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        args = sys.argv[1:] if args is None else args
        return super().parse_known_args([_dashed(arg) for arg in args], namespace)


def _dashed(arg: str) -> str:
    """``--name_with_underscores[=value]`` with dashes in the name; anything else as it is."""
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    return name.replace("_", "-") + equals + value
