"""Checkpoint files one process can check: atomic writes and swaps (:mod:`.atomic`), what a reader
refuses and says (:mod:`.checkpoint_files`, :func:`.sharded.check_sharded`), ``ckpt_path="last"``'s
choice (:mod:`.resume`) and the module after ``fit`` (:mod:`.after_fit`).

The oracles: for a write stopped after any number of bytes, the final name holds the old content
or the new, whole; for a file cut short anywhere, the reader refuses it and names it; a directory
whose parts come from two saves is refused with each part and its step.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_pipe.cli import main
from lightning_pipe.errors import CheckpointError, IncompleteCheckpoint
from lightning_pipe.strategy import PipelineStrategy, atomic
from lightning_pipe.strategy.after_fit import fill, guard, lift_guard
from lightning_pipe.strategy.atomic import TEMPORARY, publish, remove, sweep, write_file
from lightning_pipe.strategy.checkpoint_files import check_same_model, complete_beside, newest_complete
from lightning_pipe.strategy.resume import complete_last
from lightning_pipe.strategy.sharded import METADATA, consolidate, save_sharded

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _dead_pid() -> int:
    """The pid of a process that has ended (and been collected)."""
    process = multiprocessing.get_context("fork").Process(target=lambda: None)
    process.start()
    process.join()
    return process.pid


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


class _Stop(Exception):
    """A write stopped half-way."""


@SETTINGS
@given(old=st.binary(max_size=64), new=st.binary(min_size=1, max_size=256), stop=st.integers(0, 256))
def test_a_write_stopped_anywhere_leaves_the_old_file(tmp_path: Path, old: bytes, new: bytes, stop: int) -> None:
    """``write_file`` stopped after ``stop`` bytes leaves the old content (or no file) and no
    temporary; run to the end it leaves the new content."""
    directory = tmp_path / str(len(list(tmp_path.iterdir())))
    directory.mkdir()
    path = directory / "last.ckpt"
    path.write_bytes(old)

    def write(handle: Any) -> None:
        handle.write(new[:stop])
        if stop < len(new):
            raise _Stop

    if stop < len(new):
        with pytest.raises(_Stop):
            write_file(path, write)
        assert path.read_bytes() == old
    else:
        write_file(path, write)
        assert path.read_bytes() == new
    assert _entries(directory) == ["last.ckpt"]


def _directory(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "part").write_text(content)
    return path


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "renamed_aside"])
def test_a_directory_replaces_a_directory_or_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange) -> None:
    """A new checkpoint directory takes the place of an old directory or file of the same name, with
    Linux's atomic swap or, where the filesystem has none, by renaming the old one aside first; a file
    takes the place of a directory; nothing else is left."""
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda first, second: False)
    path = _directory(tmp_path / "last.ckpt", "old")
    publish(_directory(tmp_path / f"{TEMPORARY}new", "new"), path)
    assert (path / "part").read_text() == "new" and _entries(tmp_path) == ["last.ckpt"]
    shutil.rmtree(path)
    path.write_text("a file")
    publish(_directory(tmp_path / f"{TEMPORARY}dir", "dir"), path)
    assert (path / "part").read_text() == "dir" and _entries(tmp_path) == ["last.ckpt"]
    write_file(path, lambda handle: handle.write(b"file again"))
    assert path.read_bytes() == b"file again" and _entries(tmp_path) == ["last.ckpt"]


def test_a_writer_killed_between_the_two_renames_is_undone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an atomic swap, a writer that dies after renaming the old checkpoint aside and before
    renaming the new one in leaves no ``last.ckpt``; the next sweep puts the old one back and removes
    the new one's temporary."""
    monkeypatch.setattr(atomic, "_exchange", lambda first, second: False)
    dead = _dead_pid()
    monkeypatch.setattr(atomic.os, "getpid", lambda: dead)  # the temporaries' names: a writer now gone
    path = _directory(tmp_path / "last.ckpt", "old")
    renames = []

    def dies_at_the_second(source: Any, target: Any) -> None:
        renames.append(target)
        if len(renames) == 2:
            raise SystemExit("killed")
        os.replace(source, target)

    monkeypatch.setattr(atomic.os, "rename", dies_at_the_second)
    with pytest.raises(SystemExit):
        publish(_directory(tmp_path / atomic.temporary_name(path).name, "new"), path)
    assert not path.exists()
    monkeypatch.undo()
    removed = sweep(tmp_path)
    assert (path / "part").read_text() == "old" and _entries(path) == ["part"]
    assert [p.name for p in removed] and _entries(tmp_path) == ["last.ckpt"]


def test_sweep_removes_only_the_temporaries_of_dead_writers_on_this_host(tmp_path: Path) -> None:
    """A dead writer's file and directory go; a live writer's (this process) and another host's stay."""
    host = socket.gethostname()
    dead = [tmp_path / f"{TEMPORARY}{host}-{_dead_pid()}-aa", tmp_path / f"{TEMPORARY}{host}-{_dead_pid()}-bb"]
    dead[0].write_bytes(b"partial")
    _directory(dead[1], "partial")
    alive = tmp_path / f"{TEMPORARY}{host}-{os.getpid()}-cc"
    elsewhere = tmp_path / f"{TEMPORARY}other-host-{_dead_pid()}-dd"
    for path in (alive, elsewhere):
        path.write_bytes(b"partial")
    (tmp_path / "last.ckpt").write_bytes(b"complete")
    assert sorted(sweep(tmp_path)) == sorted(dead)
    assert _entries(tmp_path) == sorted([alive.name, elsewhere.name, "last.ckpt"])


def test_remove_never_leaves_a_half_deleted_checkpoint_under_its_name(tmp_path: Path) -> None:
    path = _directory(tmp_path / "epoch=0-step=2.ckpt", "x")
    remove(path)
    remove(tmp_path / "missing.ckpt")
    assert _entries(tmp_path) == []


def _checkpoint(path: Path, step: int, width: int = 4) -> Path:
    torch.save({"global_step": step, "state_dict": {"w": torch.full((width,), float(step))}}, path)
    os.utime(path, (1_000_000 + step, 1_000_000 + step))
    return path


def _load(path: Path) -> dict[str, Any]:
    return PipelineStrategy().load_checkpoint(path, weights_only=False)


@SETTINGS
@given(fraction=st.floats(0.0, 0.999))
def test_a_file_cut_short_anywhere_is_refused_by_name(tmp_path: Path, fraction: float) -> None:
    """A checkpoint file cut short after any number of bytes is refused, named, with the complete
    checkpoints beside it newest first; the whole file loads."""
    directory = tmp_path / f"{fraction}"
    directory.mkdir()
    _checkpoint(directory / "epoch=0-step=2.ckpt", 2)
    _checkpoint(directory / "epoch=0-step=4.ckpt", 4)
    whole = _checkpoint(directory / "last.ckpt", 6).read_bytes()
    assert _load(directory / "last.ckpt")["global_step"] == 6
    cut = whole[: int(len(whole) * fraction)]
    (directory / "last.ckpt").write_bytes(cut)
    with pytest.raises(CheckpointError) as refused:
        _load(directory / "last.ckpt")
    message = str(refused.value)
    assert message.startswith(f"{directory / 'last.ckpt'} ")
    if len(cut) == 0 or len(cut) >= 4:  # empty, or a zip archive's start: known incomplete
        assert isinstance(refused.value, IncompleteCheckpoint) and "is incomplete" in message
        assert "newest first: epoch=0-step=4.ckpt (" in message and "epoch=0-step=2.ckpt (" in message
    else:  # a few bytes of nothing recognisable
        assert "cannot be read as a checkpoint" in message


def test_what_is_not_a_checkpoint_is_named(tmp_path: Path) -> None:
    """A file torch cannot read, a directory of no checkpoint, and a missing file."""
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"notes.ckpt cannot be read as a checkpoint \(.*\); it is damaged"):
        _load(tmp_path / "notes.ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty is a directory without the files of a sharded checkpoint"):
        _load(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        _load(tmp_path / "missing.ckpt")


def _sharded(path: Path, step: int, save: str) -> Path:
    """A one-rank sharded checkpoint as the strategy writes it."""
    path.mkdir(parents=True)
    trees = {"state_dict": {"net.weight": torch.full((3, 2), float(step))}, "optimizer": {}, "carried": {}}
    save_sharded(path, {"global_step": step, "optimizer_states": []}, trees, {"save": save, "step": step}, True, None)
    return path


def test_a_sharded_directory_missing_or_mixing_parts_is_refused(tmp_path: Path) -> None:
    """Every reader (a resume, ``consolidate``, the command) refuses a sharded checkpoint without its
    ``meta.pt``, its ``.metadata`` or a rank's file, or with a file cut short, naming the part; and
    one whose loop state and weights come from different saves, naming each part with its step."""
    good = _sharded(tmp_path / "good", 4, "a")
    assert consolidate(good)["state_dict"]["net.weight"].eq(4).all()
    cases = {
        "no_meta": (lambda d: (d / METADATA).unlink(), r"is incomplete: it has no meta.pt"),
        "no_index": (lambda d: (d / ".metadata").unlink(), r"is incomplete: it has no .metadata"),
        "no_shard": (lambda d: (d / "__0_0.distcp").unlink(), r"rank 0's stages \(__0_0.distcp\) is missing"),
        "cut": (lambda d: os.truncate(d / "__0_0.distcp", 10), r"rank 0's stages \(__0_0.distcp\) is cut short"),
    }
    for name, (damage, message) in cases.items():
        broken = tmp_path / name
        shutil.copytree(good, broken)
        damage(broken)
        for read in (_load, consolidate):
            with pytest.raises(IncompleteCheckpoint, match=message):
                read(broken)
        assert main(["consolidate", str(broken), str(tmp_path / f"{name}.out")]) == 2
        assert not (tmp_path / f"{name}.out").exists()
    mixed = tmp_path / "mixed"
    shutil.copytree(good, mixed)
    shutil.copy(_sharded(tmp_path / "older", 2, "b") / METADATA, mixed / METADATA)
    pattern = r"mixed mixes parts of different saves.*meta.pt \(the loop state\): step 2, save b; rank 0's stages"
    for read in (_load, consolidate):
        with pytest.raises(CheckpointError, match=pattern + r" \(__0_0.distcp\): step 4, save a"):
            read(mixed)


def test_a_foreign_checkpoint_names_its_entries() -> None:
    """Another model's ``state_dict``: entries missing, unexpected and of other shapes are named."""
    held = dict(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)).state_dict(keep_vars=True))
    check_same_model("a.ckpt", "Net", held, {name: value.detach() for name, value in held.items()})
    saved = {"0.weight": torch.zeros(4, 2), "0.bias": torch.zeros(3), "head.weight": torch.zeros(1)}
    with pytest.raises(CheckpointError) as refused:
        check_same_model("a.ckpt", "Net", held, saved)
    assert str(refused.value).startswith(
        "a.ckpt is not a checkpoint of this Net: 2 entries of the module missing from it: 1.weight, 1.bias; "
        "1 entries the module does not have: head.weight; 1 entries of another shape: 0.weight (4, 2) "
        "(the module's: (3, 2))"
    )


def test_last_resumes_from_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    """``ckpt_path="last"``: an incomplete ``last.ckpt`` newer than a complete ``last-v1.ckpt`` is
    skipped for it (with a warning naming it); a complete newest one is left to Lightning."""
    callback = ModelCheckpoint(dirpath=tmp_path)
    trainer = type("Trainer", (), {"callbacks": [callback]})()

    def fit(model: object, ckpt_path: str | None = None) -> None: ...

    _checkpoint(tmp_path / "last-v1.ckpt", 4)
    _checkpoint(tmp_path / "last.ckpt", 6)
    assert complete_last(fit, ("model",), {"ckpt_path": "last"}, trainer) == (("model",), {"ckpt_path": "last"})
    whole = (tmp_path / "last.ckpt").read_bytes()
    (tmp_path / "last.ckpt").write_bytes(whole[: len(whole) // 2])
    with pytest.warns(UserWarning, match=r"last.ckpt is incomplete .*; resuming from .*last-v1.ckpt"):
        args, kwargs = complete_last(fit, ("model", "last"), {}, trainer)
    assert args == ("model", str(tmp_path / "last-v1.ckpt")) and kwargs == {}
    assert complete_last(fit, ("model",), {"ckpt_path": "best"}, trainer) == (("model",), {"ckpt_path": "best"})
    assert newest_complete([tmp_path / "last.ckpt", tmp_path / "none.ckpt"]) == (None, [tmp_path / "last.ckpt"])
    assert complete_beside(tmp_path / "last.ckpt") == [tmp_path / "last-v1.ckpt"]


def test_the_module_after_fit() -> None:
    """A module holding meta tensors refuses ``forward`` with how to get the full model; ``fill``
    gives each its value (a tied weight stays tied); lifting the guard lets the strategy run it."""
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    net[1].weight = net[0].weight  # tied
    full = {name: value.detach().clone() for name, value in net.state_dict().items()}
    net[0].to("meta")
    net[1].weight = net[0].weight
    guard(net)
    with pytest.raises(RuntimeError, match=r"trainer.save_checkpoint\(path\).*gather_after_fit=True"):
        net(torch.ones(1, 2))
    fill([net], net, full)
    assert net[0].weight is net[1].weight and not net[0].weight.is_meta
    assert all(torch.equal(net.state_dict()[name], value) for name, value in full.items())
    net(torch.ones(1, 2))
    guard(net)
    lift_guard(net)
    net(torch.ones(1, 2))
