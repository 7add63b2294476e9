"""Reading one checkpoint file without running its code: torch's weights-only unpickler with a short allow-list,
safetensors without unpickling, and the full unpickler only for a file the user trusts.

The lowest layer of checkpoint reading: ``ssl_xcit.models.checkpoint`` (files and folders, state dicts,
backbones) and ``ssl_xcit.models.sharded`` (FSDP2 folders) both build on it, and it imports neither, so those two
no longer import each other.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from ssl_xcit.errors import UserError

# What ssl-xcit export writes besides weights: programs that run the backbone but cannot be trained or loaded.
_PROGRAMS = {".onnx": "an ONNX model", ".pt2": "a torch.export program"}

# Set by the command line's ``--trust-checkpoint`` (``ssl_xcit.cli``); Python callers pass ``trust=True``.
TRUST_FROM_CLI = False


def safe_globals() -> list[Any]:
    """The few non-tensor types real checkpoints hold, allowed in the weights-only unpickler: official DINO's
    ``args`` (``argparse.Namespace``) and Lightning's hyper-parameter containers. Anything else (a class, a
    function, ``os.system``) is refused, so opening a checkpoint cannot run code."""
    import argparse

    allowed: list[Any] = [argparse.Namespace]
    try:
        from lightning.fabric.utilities.data import AttributeDict

        allowed.append(AttributeDict)
    except ImportError:  # pragma: no cover - lightning is a dependency
        pass
    return allowed


def read_checkpoint_file(path: str | os.PathLike, trust: bool = False) -> Any:
    """``torch.load`` on CPU with torch's weights-only unpickler and an allow-list (:func:`_safe_globals`);
    a safetensors file is read with safetensors (no unpickling at all, so ``trust`` does not apply).

    Args:
        path: the checkpoint file.
        trust: unpickle fully when the safe load refuses the file. Only for files you trust: a pickle can run
            any code. The command line's ``--trust-checkpoint`` sets it for every checkpoint a command reads.

    Returns:
        The loaded object. Raises ``FileNotFoundError`` for a missing file and a one-line ``UserError`` naming
        the file, the refused content and ``--trust-checkpoint`` when the safe load refuses it.
    """
    from ssl_xcit.models.export import is_safetensors, read_safetensors

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    if path.suffix.lower() in _PROGRAMS:
        raise UserError(
            f"{path} is {_PROGRAMS[path.suffix.lower()]}, a traced program rather than weights: pass the "
            ".safetensors (or .pth) that ssl-xcit export writes"
        )
    if is_safetensors(path):
        return read_safetensors(path)
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as safe_error:  # noqa: BLE001 - reported below, or retried only when trusted
        text = str(safe_error)
        found = re.search(r"GLOBAL (\S+)", text)
        opcode = re.search(r"Unsupported operand (\d+)", text)
        if found is None and opcode is None:  # a truncated or non-pickle file: trust cannot mend it
            raise UserError(f"cannot read checkpoint {path}: {safe_error}") from safe_error
        if not (trust or TRUST_FROM_CLI):
            if found is None:  # a pickle instruction the safe loader refuses, or simply a corrupt file
                raise UserError(
                    f"cannot read checkpoint {path}: the weights-only loader refuses its pickle instruction "
                    f"{opcode.group(1)} (a corrupt file, or a pickle that could run code); if you trust the file, "
                    "pass --trust-checkpoint (trust=True in Python)"
                ) from safe_error
            raise UserError(
                f"refusing to unpickle checkpoint {path}: it holds {found.group(1)}, outside the weights-only "
                "allow-list, and loading it could run code. If you trust the file, pass --trust-checkpoint "
                "(trust=True in Python)"
            ) from safe_error
    warnings.warn(
        f"unpickling {path} with the full unpickler (--trust-checkpoint): it can run code",
        stacklevel=2,
    )
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise UserError(f"cannot read checkpoint {path}: {error}") from error
