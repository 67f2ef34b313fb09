"""Reading the files a user names (profiles, plans, stage costs): a file that cannot be read, or is
not JSON, is refused with its path and what it should have been."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning_pipe.errors import PlanningError

__all__ = ["json_kind", "parse_json", "read_json", "read_text"]

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
