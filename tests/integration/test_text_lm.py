"""The byte-level language model example (examples/text_lm): its data, its model, a run.

The data and the model are plain PyTorch, tested here without Flower: each site holds whole
packages of the standard library's source (disjoint, balanced by size, tests and data
packages left out), the server's test windows come from the top-level modules no site
holds, and a window is the bytes at its position. The model is causal: a byte never sees
the bytes after it. Then one real run, `flplatform run examples/text_lm` with DiLoCo's outer
step, as a user would start it.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from flplatform.cli.app import app
from storage import LedgerRepository

ROOT = Path(__file__).resolve().parents[2]
TEXT_LM = ROOT / "examples" / "text_lm"


def _load_task() -> ModuleType:
    """The example's task module (plain PyTorch: it imports nothing of its own package)."""
    spec = importlib.util.spec_from_file_location("text_lm_task", TEXT_LM / "text_lm" / "task.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


task = _load_task()
STDLIB = task.stdlib_dir()


def _fake_stdlib(root: Path, packages: dict[str, dict[str, bytes]]) -> Path:
    """A standard-library-shaped folder: package → relative file path → contents."""
    for package, files in packages.items():
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_bytes(b"")
        for name, text in files.items():
            (root / package / name).parent.mkdir(parents=True, exist_ok=True)
            (root / package / name).write_bytes(text)
    return root


# ----------------------------------------------------------------------------- the split
@pytest.mark.parametrize("num_sites", [1, 2, 8, 100])
def test_each_site_holds_its_own_packages_and_together_all_of_them(num_sites: int) -> None:
    held = task.site_packages(STDLIB, num_sites)
    assert len(held) == num_sites and all(held)
    files = [file for site in held for unit in site for file in unit.files]
    assert len(files) == len(set(files))  # no file at two sites
    everything = {file for unit in task.packages(STDLIB) for file in unit.files}
    assert set(files) == everything
    assert held == task.site_packages(STDLIB, num_sites)  # the same split every time
    for file in files:
        inside = file.relative_to(STDLIB).parts
        assert inside[0] not in task.LEFT_OUT and not task.TEST_FOLDERS & set(inside[:-1])
    if num_sites <= len(task.packages(STDLIB)):  # whole packages, none split
        names = [unit.name for site in held for unit in site]
        assert all("[" not in name for name in names)


def test_the_sites_are_balanced_and_named_after_their_largest_package() -> None:
    held = task.site_packages(STDLIB, 8)
    sizes = [sum(unit.size for unit in site) for site in held]
    largest = max(unit.size for unit in task.packages(STDLIB))
    # greedy by size: no site exceeds the smallest by more than the largest package
    assert max(sizes) - min(sizes) <= largest
    names = [task.site_name(i, 8) for i in range(8)]
    assert len(set(names)) == 8
    for name, site in zip(names, held, strict=True):
        assert name == max(site, key=lambda unit: unit.size).name


def test_the_sites_code_differs_more_than_two_halves_of_one_sites() -> None:
    """Non-IID by construction: the byte frequencies of two sites differ more than those
    of two random halves of one site's windows (total variation distance): beyond
    sampling noise."""

    def frequencies(windows: torch.Tensor) -> np.ndarray:
        counts = np.bincount(windows.reshape(-1).numpy(), minlength=256).astype(float)
        return counts / counts.sum()

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return 0.5 * float(np.abs(frequencies(a) - frequencies(b)).sum())

    sites = [task.load_data(i, 4, windows_per_site=2000)[0] for i in range(4)]
    halves = [s[torch.randperm(len(s), generator=torch.Generator().manual_seed(0))] for s in sites]
    within = [distance(h[: len(h) // 2], h[len(h) // 2 :]) for h in halves]
    between = [distance(a, b) for i, a in enumerate(sites) for b in sites[i + 1 :]]
    assert min(between) > max(within), (between, within)


def test_more_sites_than_source_files_is_refused(tmp_path: Path) -> None:
    root = _fake_stdlib(tmp_path, {"alpha": {"a.py": b"x = 1\n"}, "beta": {"b.py": b"y = 2\n"}})
    assert len(task.site_packages(root, 4)) == 4  # each package's __init__.py and module
    with pytest.raises(task.DataError, match="4 source units to share; 5 sites"):
        task.site_packages(root, 5)


def test_left_out_packages_and_test_folders_are_skipped(tmp_path: Path) -> None:
    root = _fake_stdlib(
        tmp_path,
        {
            "alpha": {"a.py": b"a\n", "tests/test_a.py": b"t\n", "sub/b.py": b"b\n"},
            "encodings": {"utf_8.py": b"e\n"},
            "test": {"test_x.py": b"x\n"},
        },
    )
    (only,) = task.packages(root)
    assert only.name == "alpha"
    assert [f.relative_to(root).as_posix() for f in only.files] == [
        "alpha/__init__.py",
        "alpha/a.py",
        "alpha/sub/b.py",
    ]


# ---------------------------------------------------------------------------- windows
def test_a_window_is_the_bytes_at_its_position(tmp_path: Path) -> None:
    """Against the text itself: 1000 random bytes (no two windows alike), windows at
    multiples of 65."""
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    noise = np.random.default_rng(0).integers(0, 256, 999, dtype=np.uint8).tobytes()
    first.write_bytes(noise[:600])
    second.write_bytes(noise[600:])
    text = first.read_bytes() + b"\n" + second.read_bytes()  # how the files are joined
    windows = task.windows([first, second], count=5, seed=3)
    span = task.CONTEXT + 1
    assert windows.shape == (5, span) and windows.dtype == torch.int64
    starts = []
    for window in windows.tolist():
        start = next(
            s for s in range(0, len(text) - span + 1, span) if list(text[s : s + span]) == window
        )
        starts.append(start)
    assert starts == sorted(set(starts))  # distinct positions, in order
    assert torch.equal(windows, task.windows([first, second], count=5, seed=3))
    assert len(task.windows([first, second], count=100, seed=3)) == len(text) // span


def test_the_servers_test_windows_come_from_the_top_level_modules(tmp_path: Path) -> None:
    """Each test window is text of the top-level modules (none of a package's, which are
    the sites'); a library without source files is refused."""
    root = _fake_stdlib(tmp_path / "lib", {"alpha": {"a.py": b"p" * 3000}})
    noise = np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    (root / "one.py").write_bytes(noise[:2000])
    (root / "two.py").write_bytes(noise[2000:])
    text = (root / "one.py").read_bytes() + b"\n" + (root / "two.py").read_bytes()
    test = task.load_test_data(count=16, root=root)
    assert test.shape == (16, task.CONTEXT + 1)
    assert all(bytes(window.tolist()) in text for window in test)
    (root / "one.py").unlink()
    (root / "two.py").unlink()
    with pytest.raises(task.DataError, match="without its source"):
        task.load_test_data(root=root)


# ------------------------------------------------------------------------------ model
def test_the_model_predicts_each_byte_from_the_bytes_before_it_only() -> None:
    torch.manual_seed(0)
    model = task.ByteTransformer(width=32, layers=2, heads=4).eval()
    tokens = torch.randint(256, (3, task.CONTEXT))
    changed = tokens.clone()
    changed[:, 40] = (changed[:, 40] + 1) % 256
    with torch.no_grad():
        logits, after = model(tokens), model(changed)
    assert logits.shape == (3, task.CONTEXT, task.VOCABULARY)
    assert torch.equal(logits[:, :40], after[:, :40])  # the past does not see byte 40
    assert not torch.equal(logits[:, 40:], after[:, 40:])


def test_each_seed_round_and_site_draws_batches_of_its_own() -> None:
    triples = [(s, r, p) for s in range(3) for r in range(6) for p in range(8)]
    seeds = [task.site_seed(*triple) for triple in triples]
    assert len(set(seeds)) == len(triples)  # seed 1's round 1 is not seed 0's round 2
    assert task.site_seed(1, 1, 0) != task.site_seed(0, 2, 0)
    assert seeds == [task.site_seed(*triple) for triple in triples]  # and again the same


def test_training_lowers_the_loss_from_a_uniform_guess() -> None:
    torch.manual_seed(0)
    model = task.ByteTransformer(width=32, layers=1, heads=2)
    data, held_out = task.load_data(0, 8, windows_per_site=600)
    before, _ = task.test(model, held_out)
    assert before == pytest.approx(task.UNIFORM_LOSS, abs=0.5)
    task.train(model, data, steps=40, batch_size=32, lr=3e-3, seed=0)
    after, accuracy = task.test(model, held_out)
    assert after < task.UNIFORM_LOSS - 1.5 and accuracy > 0.15


# ------------------------------------------------------------------------------ a run
@pytest.mark.slow
@pytest.mark.usefixtures("flplatform_home")
def test_flplatform_run_of_the_example_with_dilocos_outer_step(tmp_path: Path) -> None:
    app_dir = tmp_path / "text_lm"
    shutil.copytree(TEXT_LM, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    diloco = ("server-momentum=0.9", "server-nesterov=true", "server-lr=0.7")
    args = ["run", str(app_dir), "--sites", "2", "--rounds", "2", "--db", db]
    args += ["--network", "world", "-c", "local-steps=10"]
    args += [item for key in diloco for item in ("-c", key)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        rounds, updates = repo.list_rounds(run.id), repo.list_updates(run.id)
        sites = sorted(site.name for site in repo.list_sites(run.id))
    assert run.status == "finished" and run.name == "text-lm-local-sgd"
    assert run.config["server-nesterov"] is True and run.config["server-lr"] == 0.7
    assert sites == sorted(task.site_name(i, 2) for i in range(2))  # the query named them
    assert [r.num_applied for r in rounds] == [2, 2]
    losses = [r.metrics["loss"] for r in rounds]
    assert losses[1] < losses[0] < task.UNIFORM_LOSS - 1.5, losses
    parameters = sum(p.numel() for p in task.ByteTransformer().parameters())
    assert all(u.bytes_up >= 4 * parameters for u in updates)  # whole models go up
    assert run.simulated_seconds is not None and math.isfinite(run.simulated_seconds)
