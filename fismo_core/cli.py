"""The ``fismo`` command line (also ``python -m fismo_core``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Optional


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fismo", description="FISMO optimizer: reference implementation tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify",
        help="check FISMO on every installed backend, device and dtype against NumPy float64",
        description="Run a seeded FISMO trajectory on every installed backend, device and dtype, "
        "print the worst relative error against NumPy float64, and exit 1 on any failure.",
    )
    verify.add_argument("--steps", type=int, default=50, help="steps per trajectory (default 50)")
    verify.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "verify":
        if args.steps < 1:
            parser.error("verify: --steps must be a positive integer")
        from .verify import main as verify_main

        return verify_main(steps=args.steps, seed=args.seed)
    raise AssertionError(args.command)  # argparse rejects unknown commands


if __name__ == "__main__":
    raise SystemExit(main())
