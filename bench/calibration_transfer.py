"""How well the calibrations earlier fits kept price the next fit: the rule that picks the kept
calibration closest to a configuration (``RunShape.closeness`` in ``lightning_pipe/cost/calibrated.py``)
against other rules, replayed on the calibrations real fits kept.

Run: ``python bench/calibration_transfer.py [DIR ...]`` (default: the directories ``bench/auto_plan.py``
kept its profiles and calibrations in, ``$TMPDIR/auto_plan_profiles_*``; seconds).

A calibration file lists the fits of one model in the order they were kept (the last five of each
shape). Each fit of a family no earlier fit of the model ran is priced, as that fit's set-up
prediction was, from the calibrations kept before it; each rule picks one, and the table gives how far
the picked calibration's rate (``scale``: the in-run actions over the profile) lies from the rate the
fit itself then measured, ``|picked / own - 1|``: its median, its mean and the fits within 10%, over
every such fit and over those where the rules picked differently. The rate is what carries from one
family to another; the time beyond the actions (``per_step``) is fitted against each run's own
simulation and is left out. The rules, each pricing with the fits kept of the closest shape (their
median, as the package does: ``closest_fits``, ``typical``), the same pinning first:

- ``replication``: the same family and rows, else the same rows and replication (Rahimi's placed
  families and 1F1B-RR against the pipelines), else the same family, else the same replication, else
  the same rows;
- ``+ stages per worker``: the same rows and kind before the same rows and replication, a kind also
  telling one stage per worker from several (interleaved, looped BFS);
- ``+ split backward`` (the package's rule): the kind also telling a backward in two actions (ZB-H1)
  from one.

A second table asks which fits to price a shape new to the model with (a family, rows and pinning no
earlier fit ran, its family perhaps run before at other rows or pinning): those of the one closest
shape, the last kept among the equally close (the package's, ``KeptFits.closest``), or those of every
shape as close, pooled (their lower median, the last five). A third asks it of a shape kept before:
its own fits (the package's), or the last fit of its rows and kind whatever its pinning, or the last
of another family: how much of a fit's rate is the machine's drift since its shape last ran. The
package's rule follows half of that drift, as later fits of the kind measured it (``machine_drift``);
both tables also give the same fits with no drift followed, and the third with all of it.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_pipe.cost.calibrated import (
    DRIFT_SHARE,
    KEPT_PER_SHAPE,
    REPLICATING_FAMILIES,
    Calibration,
    KeptFits,
    Kind,
    RunShape,
    closest_fits,
    closest_kept,
    family_kind,
    typical,
)
from lightning_pipe.schedule.options import LOOPED_FAMILIES

Entry = dict[str, object]
Rule = Callable[[Entry, list[Entry]], Calibration]
"""What prices a fit from the fits kept before it."""

KINDS: dict[str, Kind] = {
    "replication": lambda family: (family in REPLICATING_FAMILIES,),
    "+ stages per worker": lambda family: (family in REPLICATING_FAMILIES, family in LOOPED_FAMILIES),
    "+ split backward (the package's)": family_kind,
}
"""How each rule tells families apart; every rule ranks with ``RunShape.closeness``."""


def histories(files: list[Path]) -> list[list[Entry]]:
    """The fits each calibration file of ``files`` lists, in the order kept (one model each)."""
    return [json.loads(path.read_text())["runs"] for path in files]


def _fits(kept: list[list[Entry]], which: Callable[[Entry, list[Entry]], bool]) -> Iterator[tuple[Entry, list[Entry]]]:
    """Each fit of the ``kept`` histories that ``which`` takes, with the fits of its model kept before it."""
    for runs in kept:
        for index, entry in enumerate(runs):
            earlier = runs[:index]
            if earlier and which(entry, earlier):
                yield entry, earlier


def first_fits(kept: list[list[Entry]]) -> Iterator[tuple[Entry, list[Entry]]]:
    """Each fit of a family new to its model, with the fits kept before it."""
    return _fits(kept, lambda entry, earlier: all(other["family"] != entry["family"] for other in earlier))


def new_shapes(kept: list[list[Entry]]) -> Iterator[tuple[Entry, list[Entry]]]:
    """Each fit of a shape (family, rows, pinning) new to its model, with the fits kept before it."""
    return _fits(kept, lambda entry, earlier: not any(_shape(entry).matches(other) for other in earlier))


def kept_shapes(kept: list[list[Entry]]) -> Iterator[tuple[Entry, list[Entry]]]:
    """Each fit of a shape its model kept fits of before, with the fits kept before it."""
    return _fits(kept, lambda entry, earlier: any(_shape(entry).matches(other) for other in earlier))


def _shape(entry: Entry) -> RunShape:
    return RunShape(str(entry["family"]), int(entry["rows"]), bool(entry["pinned"]))


def picked(kind: Kind, entry: Entry, earlier: list[Entry]) -> Calibration:
    """The calibration the rule telling families apart by ``kind`` prices ``entry`` with from ``earlier``."""
    return typical(closest_fits(earlier, _shape(entry), kind))


def package(entry: Entry, earlier: list[Entry], drift_share: float = DRIFT_SHARE) -> Calibration:
    """The package's own lookup (``KeptFits.closest``): the fits of the shape kept closest to ``entry``'s,
    their rate following ``drift_share`` of the machine's drift since (``machine_drift``; the package's:
    half; 0, the package's before 2026-11-30)."""
    found = KeptFits(tuple(earlier)).closest(_shape(entry), drift_share)
    assert found is not None, "a fit with fits kept before it is priced"
    return found


def pooled(entry: Entry, earlier: list[Entry]) -> Calibration:
    """The calibration of the last :data:`KEPT_PER_SHAPE` fits in ``earlier`` of every shape as close to
    ``entry``'s as the closest (``RunShape.closeness``)."""
    shape = _shape(entry)
    level = shape.closeness(closest_kept(earlier, shape))
    return typical([other for other in earlier if shape.closeness(other) == level][-KEPT_PER_SHAPE:])


SHAPE_RULES: dict[str, Rule] = {
    "the closest shape (the package's)": package,
    "the closest shape, no drift followed": functools.partial(package, drift_share=0.0),
    "every shape as close, pooled": pooled,
}
"""Which kept fits price a shape new to the model."""


def latest(entry: Entry, earlier: list[Entry], other_family: bool = False) -> Calibration:
    """The last fit in ``earlier`` of ``entry``'s rows and kind (:func:`family_kind`), whatever its
    pinning (``other_family``: of another family than ``entry``'s), else the package's pick."""
    alike = [
        other
        for other in earlier
        if other["rows"] == entry["rows"]
        and family_kind(other["family"]) == family_kind(entry["family"])
        and not (other_family and other["family"] == entry["family"])
    ]
    return typical(alike[-1:]) if alike else package(entry, earlier)


AGAIN_RULES: dict[str, Rule] = {
    "its shape's fits (the package's)": package,
    "its shape's fits, no drift followed": functools.partial(package, drift_share=0.0),
    "its shape's fits, all the drift followed": functools.partial(package, drift_share=1.0),
    "the last fit of its rows and kind": latest,
    "the last of another family": lambda entry, earlier: latest(entry, earlier, other_family=True),
}
"""Which kept fits price a shape kept before: its own, or the most recent of its kind (the machine's drift)."""


def _summary(errors: list[float]) -> str:
    if not errors:
        return "- | - | -"
    within = sum(error <= 0.10 for error in errors)
    return f"{statistics.median(errors):.0%} | {statistics.mean(errors):.0%} | {within} of {len(errors)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directories", nargs="*", type=Path)
    args = parser.parse_args(argv)
    directories = args.directories or sorted(Path(tempfile.gettempdir()).glob("auto_plan_profiles_*"))
    files = [path for directory in directories for path in sorted(directory.glob("calibration-*.json"))]
    kept = histories(files)
    fits = list(first_fits(kept))
    if not fits:
        parser.error("no calibration kept there: run bench/auto_plan.py first, or name its directories")
    print(f"{len(fits)} first fits of a family, {len(files)} calibration files in {len(directories)} directories")
    _table(fits, {name: functools.partial(picked, kind) for name, kind in KINDS.items()})
    shapes = list(new_shapes(kept))
    print(f"\n{len(shapes)} first fits of a shape")
    _table(shapes, SHAPE_RULES)
    again = list(kept_shapes(kept))
    print(f"\n{len(again)} fits of a shape kept before")
    _table(again, AGAIN_RULES)


def _table(fits: list[tuple[Entry, list[Entry]]], rules: dict[str, Rule]) -> None:
    """How far the rate each rule prices each of ``fits`` with lies from the fit's own, over every fit
    and over those where the rules picked differently."""
    picks = {name: [rule(entry, earlier) for entry, earlier in fits] for name, rule in rules.items()}
    errors = {
        name: [abs(p.scale / float(entry["scale"]) - 1) for p, (entry, _) in zip(chosen, fits, strict=True)]
        for name, chosen in picks.items()
    }
    differ = [i for i in range(len(fits)) if len({chosen[i] for chosen in picks.values()}) > 1]
    print("| rule | all: median | mean | within 10% | where the rules differ: median | mean | within 10% |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, found in errors.items():
        print(f"| {name} | {_summary(found)} | {_summary([found[i] for i in differ])} |")


if __name__ == "__main__":
    main()
