"""The ``fismo`` command line (also ``python -m fismo_core``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Optional


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="fismo", description="FISMO optimizer: reference implementation tools.")
    parser.add_argument("--version", action="version", version=f"fismo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify",
        help="check FISMO on every installed backend, device and dtype against NumPy float64",
        description="Run seeded Gaussian gradient streams and gradients recorded from real models through "
        "FISMO on every installed backend, device and dtype; compare every line of Algorithm 1 at every step "
        "with NumPy float64; print the worst relative error and, on failure, the first step and line that "
        "left the tolerance. Exit status: 0 all passed, 1 a target failed, 2 usage or reference-file error, 130 "
        "interrupted (Ctrl-C).",
    )
    verify.add_argument("--steps", type=int, default=None,
                        help="steps of the Gaussian streams (default 50); the recorded streams run min(steps, 16)")
    verify.add_argument("--seed", type=int, default=None, help="seed of the Gaussian streams (default 0)")
    verify.add_argument("--save", metavar="PATH", help="also write the NumPy float64 reference to PATH (.npz)")
    verify.add_argument(
        "--against", metavar="PATH", help="check against the reference file PATH instead of computing NumPy float64 here"
    )
    verify.add_argument("--explain", action="store_true", help="print every line's error at each failure")
    verify.set_defaults(command_parser=verify)  # its usage errors print its usage line, not the top level's
    demo = sub.add_parser(
        "demo",
        help="train small models on CPU with FISMO, Muon, AdamW, SGD and SOAP; write tables and plots",
        description="Train a CNN on scikit-learn's digits and a byte-level GPT on the Python standard "
        "library's source, on the CPU and offline, with FISMO (printed and scale-invariant statistics, "
        "and the training configuration FISMO-T), Muon (configured as printed FISMO, and torch.optim.Muon at "
        "its defaults), AdamW, SGD and SOAP: a learning-rate sweep per optimizer, the best of each over seeds, "
        "condition numbers of the updates and FISMO's preconditioners. 24 CPU-minutes on a CPU with bfloat16 "
        "instructions (AVX-512 BF16; more where bfloat16 is emulated) (--quick: 2.3 to 7 CPU-minutes); see "
        "docs/results.md.",
    )
    demo.add_argument("--out", default="fismo-results", help="output directory (default fismo-results/)")
    demo.add_argument("--quick", action="store_true", help="fewer steps and seeds, a smoke test: 2.3 to 7 CPU-minutes (1 min 15 s to 3 min 22 s on 2 "
                      "cores; the less where the CPU has bfloat16 instructions, as the README measures)")
    demo.add_argument("--tasks", default="digits,text", help="comma-separated: digits, text (default both)")
    demo.add_argument(
        "--optimizers",
        default=None,
        help="comma-separated subset of FISMO, FISMO-SI, FISMO-T, Muon, Muon-torch, AdamW, SGD, SOAP (default all)",
    )
    demo.add_argument("--seeds", type=int, default=None, help="seeds per optimizer (default 3; --quick 2)")
    demo.add_argument("--steps", type=int, default=None, help="training steps of every task (overrides the preset)")
    demo.add_argument("--jobs", type=int, default=2, help="runs in parallel, one torch thread each (default 2)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(command_parser=demo)
    return parser


#: The exit status of a command ended by Ctrl-C, as a shell reports one killed by SIGINT (128 + 2).
INTERRUPTED = 130


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``fismo``: parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # in the command's usage, as its other errors ("fismo verify extra" printed the top level's)
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return _run(args, argv)
    except KeyboardInterrupt:  # one line, not a traceback; nothing is half-written (verify's --save, the report)
        if args.command == "demo":
            unwritten = f"; no report was written to {args.out}"
        else:
            unwritten = "" if args.save is None else f"; no reference was written to {args.save}"
        print(f"\nfismo {args.command}: interrupted{unwritten}", file=sys.stderr)
        return INTERRUPTED


def _run(args: argparse.Namespace, argv: Optional[Sequence[str]]) -> int:
    """Run the command ``args`` names (``argv``: as `main` was given it, for the demo's record of the command)."""
    usage_error = args.command_parser.error  # "usage: fismo verify ..." and "fismo verify: error: ..."
    if args.command == "verify":
        if args.steps is not None and args.steps < 1:
            usage_error("--steps must be a positive integer")
        if args.seed is not None and args.seed < 0:  # NumPy's generators take seeds >= 0
            usage_error("--seed must be an integer >= 0")
        if args.against is not None and (args.steps is not None or args.seed is not None or args.save is not None):
            usage_error("--against takes the streams, steps and seed from the reference file; "
                         "drop --steps, --seed and --save")
        from .verify import main as verify_main

        return verify_main(
            steps=50 if args.steps is None else args.steps,
            seed=0 if args.seed is None else args.seed,
            save=args.save,
            against=args.against,
            explain=args.explain,
        )
    if args.command == "demo":
        for name in ("seeds", "steps", "jobs"):
            value = getattr(args, name)
            if value is not None and value < 1:
                usage_error(f"--{name} must be a positive integer")
        missing = [name for module, name in (("torch", "torch"), ("sklearn", "scikit-learn"))
                   if importlib.util.find_spec(module) is None]
        if missing:  # before the runs: without scikit-learn the first run raised, a traceback
            print(f"fismo demo: needs {' and '.join(missing)}: pip install 'fismo[demo]'", file=sys.stderr)
            return 2
        if not args.out:
            usage_error("--out must name a directory (it was empty)")
        from .demo import default_config
        from .demo import main as demo_main
        from .demo import out_directory

        try:
            config = default_config(
                args.quick,
                tasks=tuple(args.tasks.split(",")),
                optimizers=None if args.optimizers is None else tuple(args.optimizers.split(",")),
                seeds=args.seeds,
                steps=args.steps,
                jobs=args.jobs,
            )
        except ValueError as exc:  # an unknown task or optimizer name
            usage_error(str(exc))
        from .demo.optimizers import soap_available

        if set(config.optimizers) == {"SOAP"} and not soap_available():  # SOAP alone: nothing would run
            usage_error("--optimizers SOAP needs pytorch-optimizer (pip install pytorch-optimizer), which is "
                        "not installed; name another optimizer too, or install it")
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            usage_error(f"--out {args.out} is a file; the report is a directory")
        try:
            out_directory(args.out)
        except OSError as exc:  # before the runs, not after them
            usage_error(str(exc))
        command = shlex.join(["fismo", *(argv if argv is not None else sys.argv[1:])])  # pastes back as it ran
        return demo_main(config, args.out, progress=not args.no_progress, command=command)
    raise AssertionError(args.command)  # argparse rejects unknown commands


if __name__ == "__main__":
    raise SystemExit(main())
