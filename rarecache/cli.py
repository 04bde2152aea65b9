"""The `rarecache` command.

Each command lives in its own module under `rarecache.commands`, with its flags beside its
handler; this module builds the parser from them and runs the chosen handler.

User mistakes (unknown model, bad file, bad flag value) print one line and exit 2;
anything else is a bug and keeps its traceback. A command's `--dtype` (auto by default) is settled here,
once, before its handler runs (commands/common.py `settle_dtype`, the rule in dtypes.py).
"""

from __future__ import annotations

import argparse
import os
import sys

from .commands import REGISTER
from .commands.common import settle_dtype
from .errors import RarecacheError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rarecache",
        description="Cross-model KV-cache handoff: map a small model's KV cache into a large one's, "
                    "recompute only the positions the map gets wrong, decode.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in REGISTER:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settle_dtype(args)  # --dtype auto -> the dtype this machine runs fast, said once on stderr
        return args.func(args)
    except RarecacheError as e:
        print(f"rarecache: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("rarecache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
