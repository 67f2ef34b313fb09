"""Reading the files a user names (profiles, plans, stage costs): a file that cannot be read, or is
not JSON, is refused with its path and what it should have been. And the files the package keeps for
the next run (calibrations, the training loop's time): read leniently, replaced atomically."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from lightning_pipe.errors import PlanningError

__all__ = [
    "json_kind",
    "keep_run",
    "kept_document",
    "kept_number",
    "kept_runs",
    "parse_json",
    "read_json",
    "read_text",
    "replace_json",
]

_KINDS = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}


def read_text(path: str | os.PathLike[str], what: str) -> str:
    """The text of ``path``, the ``what`` (``"plan"``, ``"profile"``) a user gave."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise PlanningError(f"cannot read the {what} {path}: {reason}") from None


def read_json(path: str | os.PathLike[str], what: str) -> object:
    """The JSON document in ``path`` (see :func:`read_text`)."""
    return parse_json(read_text(path, what), path, what)


def parse_json(text: str, path: str | os.PathLike[str], what: str) -> object:
    """``text`` (read from ``path``) as JSON, or an error naming the line where it stops being JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanningError(
            f"{path}: invalid JSON at line {error.lineno}: {error.msg} (a {what} file is JSON)"
        ) from None


def json_kind(value: object) -> str:
    """What a JSON value is, in JSON's words: ``object``, ``list``, ``string``, ``number``, ..."""
    return "null" if value is None else _KINDS.get(type(value), type(value).__name__)


def kept_document(path: Path) -> dict[str, object]:
    """The JSON object a kept file holds; empty where the file is missing, unreadable or holds no
    object (it is then replaced by the next run's)."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def kept_runs(document: dict[str, object]) -> list[dict[str, object]]:
    """The entries of a kept file's ``{"runs": [...]}`` (:func:`kept_document`); none where it holds no
    such list."""
    runs = document.get("runs")
    return [entry for entry in runs if isinstance(entry, dict)] if isinstance(runs, list) else []


def kept_number(entry: dict[str, object], name: str) -> float | None:
    """``entry[name]`` where it is a finite number >= 0 (a figure a run kept); ``None`` where it is
    missing or not such a number (a file edited or damaged by hand)."""
    value = entry.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        return None
    return float(value)


def keep_run(path: Path, entry: dict[str, object], last: int) -> Path | None:
    """``entry`` kept as the last of the ``last`` runs the kept file ``path`` holds (:func:`kept_runs`;
    the oldest beyond them dropped, the file replaced atomically); the file, or ``None`` where it could
    not be written."""
    runs = [*kept_runs(kept_document(path))[-(last - 1) :], entry] if last > 1 else [entry]
    return path if replace_json(path, {"runs": runs}) else None


def replace_json(path: Path, document: object) -> bool:
    """Write ``document`` as JSON to ``path`` (its directory made where missing) through a temporary
    file beside it and an atomic rename: a run reading it at the same time finds the old file or the
    new one. Whether it could be written (the temporary file is removed where it could not)."""
    temporary: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
            temporary = Path(handle.name)
            json.dump(document, handle, indent=1)
        os.replace(temporary, path)
    except OSError:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
        return False
    return True
