"""The keyword options of a save, defined once for :func:`shardsafe.save` and
:func:`shardsafe.async_save` (``**options: Unpack[SaveOptions]``): their names, types and defaults,
the check that refuses a misspelt one, and the explicit signature ``help()`` and IDEs show."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypedDict, TypeVar

from shardsafe.coord import Deadlines
from shardsafe.errors import InvalidArgumentError, InvalidTypeError
from shardsafe.progress.record import ProgressCallback


class SaveOptions(TypedDict, total=False):
    """The keyword options of :func:`shardsafe.save` and :func:`shardsafe.async_save`, all optional
    (defaults in :data:`DEFAULTS`); their docstrings say what each does."""

    overwrite: bool
    timeout: float | Deadlines | None
    group: Any
    metadata: Any
    allow_pickle: bool
    storage_options: dict[str, Any] | None
    base: str | os.PathLike[str] | Callable[[], str | None] | None
    progress: ProgressCallback | None
    staging: Literal["blocking", "background"]
    files: Mapping[str, bytes] | None
    write_files: Callable[[str], None] | None


STAGING = ("blocking", "background")
"""The values of ``staging=``: when an asynchronous save copies the tensors (docs/async.md)."""

DEFAULTS: SaveOptions = {
    "overwrite": False,
    "timeout": None,
    "group": None,
    "metadata": None,
    "allow_pickle": False,
    "storage_options": None,
    "base": None,
    "progress": None,
    "staging": "blocking",
    "files": None,
    "write_files": None,
}


def complete(call: str, options: Mapping[str, Any]) -> SaveOptions:
    """``options`` with the defaults of those not given; an unknown name raises ``TypeError`` (as a
    misspelt keyword argument would) naming the known ones."""
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise InvalidTypeError(
            f"{call}() got an unexpected keyword argument {unknown[0]!r}; its options are {', '.join(DEFAULTS)}"
        )
    done: SaveOptions = {**DEFAULTS, **options}  # type: ignore[typeddict-item]
    if done["staging"] not in STAGING:
        raise InvalidArgumentError(
            f"{call}(staging={done['staging']!r}): give 'blocking' (copy this rank's share before returning) or "
            "'background' (return at once, copy while training goes on; docs/async.md)"
        )
    return done


F = TypeVar("F", bound=Callable[..., Any])


def spelled_out(func: F) -> F:
    """Give ``func(path, state, **options)`` the signature with every option as a keyword-only
    parameter and its default, for ``help()``, ``inspect.signature`` and editors."""
    sig = inspect.signature(func)
    fixed = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    hints = {k: getattr(v, "__forward_arg__", v) for k, v in SaveOptions.__annotations__.items()}  # as written
    keyword = inspect.Parameter.KEYWORD_ONLY
    named = [inspect.Parameter(k, keyword, default=v, annotation=hints[k]) for k, v in DEFAULTS.items()]
    func.__signature__ = sig.replace(parameters=[*fixed, *named])  # type: ignore[attr-defined]
    return func
