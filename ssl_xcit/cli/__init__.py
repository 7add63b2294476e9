"""The one command-line entry point: ``ssl-xcit <command> ...`` (also ``python -m ssl_xcit`` and ``lightning``).

    ssl-xcit fit -c recipes/quickstart.yaml          # DINO pretraining (LightningCLI)
    ssl-xcit validate -c recipes/quickstart.yaml --ckpt_path last
    ssl-xcit export CKPT OUT.safetensors               # teacher backbone (.safetensors, .pth, .onnx, .pt2)
    ssl-xcit gather-checkpoint DIR OUT.ckpt            # a sharded (FSDP2) checkpoint as one file
    ssl-xcit knn --weights W --train DIR --val DIR     # weighted k-NN on frozen features
    ssl-xcit linear --weights W --train DIR --val DIR  # linear probe
    ssl-xcit segment --weights W --train DIR --val DIR  # linear segmentation probe (mIoU)
    ssl-xcit embed --weights W --data DIR --output E.npz  # one embedding row per image
    ssl-xcit retrieval --weights W --dataset roxford5k --data-root D --method vlad
    ssl-xcit prepare DIR OUT                           # the images as LitData shards, read by every command
    ssl-xcit models                                    # list the registered backbones
    ssl-xcit plan -c recipes/dino_vit_s16.yaml --max-batch  # peak memory per GPU, estimated without a GPU

Each command lives in its own module and is imported only when used, so ``ssl-xcit models`` does not pay for
importing Lightning.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# command -> (module, function). LightningCLI subcommands share one module.
COMMANDS: dict[str, tuple[str, str]] = {
    "fit": ("ssl_xcit.cli.train", "main"),
    "validate": ("ssl_xcit.cli.train", "main"),
    "export": ("ssl_xcit.cli.export", "main"),
    "gather-checkpoint": ("ssl_xcit.cli.gather", "main"),
    "knn": ("ssl_xcit.cli.knn", "main"),
    "linear": ("ssl_xcit.cli.linear", "main"),
    "segment": ("ssl_xcit.cli.segment", "main"),
    "embed": ("ssl_xcit.cli.embed", "main"),
    "retrieval": ("ssl_xcit.cli.retrieval", "main"),
    "prepare": ("ssl_xcit.cli.prepare", "main"),
    "models": ("ssl_xcit.cli.models", "main"),
    "plan": ("ssl_xcit.cli.plan", "main"),
    "visualize": ("ssl_xcit.cli.visualize", "main"),
}
# Lightning's `test` and `predict` are not offered: no recipe's module has a test or predict step, so they could
# only fail after loading everything; `validate` is the held-out evaluation of a DINO run.
LIGHTNING_SUBCOMMANDS = ("fit", "validate")


def _usage() -> str:
    return "usage: ssl-xcit {" + ",".join(COMMANDS) + "} ...\n" + (__doc__ or "")


def main(argv: Sequence[str] | None = None) -> object:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a command and return its result (for in-process use)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        if not args:
            raise SystemExit(2)
        return None
    # --trust-checkpoint: every checkpoint this command reads may be fully unpickled (it can run code).
    from ssl_xcit.models import safe_load

    safe_load.TRUST_FROM_CLI = "--trust-checkpoint" in args
    args = [a for a in args if a != "--trust-checkpoint"]
    command = args[0]
    if command not in COMMANDS:
        raise SystemExit(f"ssl-xcit: unknown command {command!r}; valid commands: {', '.join(COMMANDS)}")
    module_name, function = COMMANDS[command]
    if command != "models":  # `models` stays free of Lightning imports
        from ssl_xcit.cli.quiet import install_filters

        install_filters()
    entry = getattr(importlib.import_module(module_name), function)
    # LightningCLI parses its own subcommand, so it gets the whole argv.
    return entry(args if command in LIGHTNING_SUBCOMMANDS else args[1:])


def console_main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: like :func:`main`, but returns nothing, so the exit status is 0 on success,
    and an expected user error ends in one or two lines and exit status 2 (``ssl_xcit.cli.errors``;
    ``--traceback`` or ``SSL_XCIT_TRACEBACK=1`` shows the traceback).

    (Console-script wrappers call ``sys.exit(entry())``; a returned results dict would be printed as an error.)
    """
    from ssl_xcit.cli.errors import report, traceback_requested, user_error

    args = list(sys.argv[1:] if argv is None else argv)
    full, args = traceback_requested(args)
    if full and argv is None:
        sys.argv = [sys.argv[0], *args]  # the parsers read sys.argv for --traceback too
    try:
        main(args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as err:
        cause = None if full else user_error(err)
        if cause is None:
            raise
        report(args[0] if args else "", cause)
