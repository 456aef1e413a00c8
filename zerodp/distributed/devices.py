"""How many GPUs one launch on this machine may use: the single count behind `make quickstart` and
`launchers/local.sh`.

    python -m zerodp.distributed.devices count            # prints an integer; 0 when no GPU is usable
    python -m zerodp.distributed.devices count --max 2    # at most 2 (what `make quickstart` starts)

The count is torch.cuda.device_count(), because CUDA applies CUDA_VISIBLE_DEVICES itself (indices,
GPU-... and MIG-... UUIDs; the list ends at the first entry that names no device) and enumerates a MIG
instance as the device a process can use. `nvidia-smi -L` is not used: it ignores CUDA_VISIBLE_DEVICES
and lists a MIG-enabled GPU and each of its instances on lines of their own.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from zerodp.errors import OneLineParser

# Values of CUDA_VISIBLE_DEVICES that hide every GPU: answered without importing torch (seconds).
_HIDES_ALL = ("", "-1", "NoDevFiles")


def usable_gpus(device_count: int, visible: str | None, max_gpus: int | None = None) -> int:
    """GPUs a launch may use: `device_count` (what CUDA enumerates, CUDA_VISIBLE_DEVICES applied),
    or 0 when `visible` (CUDA_VISIBLE_DEVICES, None when unset) hides them all; at most `max_gpus`."""
    if _hides_all(visible):
        return 0
    count = max(0, device_count)
    return count if max_gpus is None else min(count, max_gpus)


def _hides_all(visible: str | None) -> bool:
    return visible is not None and visible.strip() in _HIDES_ALL


def count_gpus(max_gpus: int | None = None, environ: Mapping[str, str] = os.environ) -> int:
    """usable_gpus of this process: 0 with a CPU build of torch or without a working driver."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if _hides_all(visible):
        return 0
    import torch  # after the check above: a CPU-only launch need not wait for it

    return usable_gpus(torch.cuda.device_count(), visible, max_gpus)


class _Parser(OneLineParser):
    def error_line(self, message: str) -> str:
        return f"{self.prog}: error: {message}; see '{self.prog} --help'"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of GPUs, 1 or more, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m zerodp.distributed.devices", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    count = sub.add_parser("count", help="print how many GPUs a launch here may use (0 when none)")
    count.add_argument("--max", type=_positive, default=None, metavar="N", help="print at most N")
    args = parser.parse_args(argv)
    print(count_gpus(args.max))
    return 0


if __name__ == "__main__":
    sys.exit(main())
