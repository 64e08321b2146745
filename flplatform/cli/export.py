"""``flplatform export RUN [--round N] --out model.pt|model.npz``: a run's global model, to use.

The model comes from the run's checkpoint (its last, or that of ``--round``): the checkpoint's
``"model"`` entry, the global model in the model's own key order. ``.pt`` is a PyTorch
``state_dict`` (an ``OrderedDict`` of CPU tensors) for ``model.load_state_dict(torch.load(
path))``; ``.npz`` is one NumPy array per parameter, in the same order.
"""

from __future__ import annotations

import os
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from flplatform.cli.errors import handles_errors
from flplatform.cli.history import DbOption, RunArgument, console, read_ledger, resolve_run
from flplatform.core.checkpoint import CheckpointError
from flplatform.core.errors import ConfigError, DataError
from flplatform.run.ledger import load_checkpoint

FORMATS = (".pt", ".npz")


@handles_errors
def export(
    run: RunArgument,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="File to write: model.pt (PyTorch) or model.npz.")
    ],
    round_: Annotated[
        int | None,
        typer.Option("--round", min=1, help="The model after this round (default: the last)."),
    ] = None,
    db: DbOption = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
) -> None:
    """Write a run's global model as a PyTorch state_dict (.pt) or NumPy arrays (.npz).

    Rounds with a model to export are those with a checkpoint: `flplatform history
    checkpoints RUN` lists them (every few rounds, the last round, and the final model).
    """
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError(
            f"--out must end in {' or '.join(FORMATS)} (a PyTorch state_dict or NumPy "
            f"arrays), got '{out}'"
        )
    if out.exists() and not force:
        raise ConfigError(f"{out} already exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise ConfigError(f"cannot write {out}: the directory {out.parent} does not exist")
    with read_ledger(db) as repository:
        run_id = resolve_run(repository, run)
        checkpoint, state = load_checkpoint(repository, run_id, round_)
    arrays = model_arrays(state, f"the checkpoint of round {checkpoint.round} of run {run_id}")
    write_model(out, arrays)
    console.print(
        f"Wrote the global model of run {run_id} after round {checkpoint.round} "
        f"(version {checkpoint.model_version}, {len(arrays)} tensors) to {out}"
    )


def model_arrays(state: dict[str, Any], where: str) -> OrderedDict[str, np.ndarray]:
    """The global model a checkpoint's state holds, by name in the model's key order."""
    from flwr.app import ArrayRecord

    model = state.get("model")
    if not isinstance(model, ArrayRecord):
        raise CheckpointError(
            f"{where} holds no global model ('model' is {type(model).__name__}, not an ArrayRecord)"
        )
    return OrderedDict((name, array.numpy()) for name, array in model.items())


def write_model(out: Path, arrays: OrderedDict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``out`` (.pt or .npz) through a temporary file, then rename.

    A failed write leaves whatever was at ``out`` as it was.
    """
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        if out.suffix.lower() == ".pt":
            import torch

            tensors = OrderedDict((n, torch.from_numpy(a.copy())) for n, a in arrays.items())
            torch.save(tensors, temporary)
        else:
            # Not np.savez(**arrays): a parameter named "file" or "allow_pickle" would clash
            # with its own arguments. np.load reads this zip the same way.
            with zipfile.ZipFile(temporary, "w", compression=zipfile.ZIP_STORED) as archive:
                for name, array in arrays.items():
                    with archive.open(f"{name}.npy", "w", force_zip64=True) as entry:
                        np.lib.format.write_array(entry, array, allow_pickle=False)
        os.replace(temporary, out)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise DataError(f"cannot write {out}: {exc.strerror or exc}") from exc
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
