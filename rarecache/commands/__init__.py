"""The `rarecache` commands, one module per group; each registers its subparsers next to its handlers.

A module's `register(sub)` adds its commands to the `rarecache` subparsers, every one with
`set_defaults(func=handler)`; REGISTER is the order `rarecache --help` lists them in (demo first,
then the pieces in the order data flows through them). Modules import only argparse-level code
at the top, so building the parser, and `--help`, loads no model code.
"""

from __future__ import annotations

from . import bench, generate, inspect, maps, models, ppl, serve, train
from . import eval as evaluation

REGISTER = (serve.register_demo, models.register, generate.register, maps.register, train.register, inspect.register,
            ppl.register, evaluation.register, serve.register, bench.register)

__all__ = ["REGISTER"]
