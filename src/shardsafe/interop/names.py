"""Whether an export's tensor names are the ones ``from_pretrained`` looks for.

``from_pretrained`` loads a weight only under the name its model gives it; any other name is ignored and
the weight it was meant for is initialised at random, with no error. The usual cause is a wrapper: a
LightningModule holding the model as ``self.model`` saves ``model.transformer.h.0...`` where GPT-2
expects ``transformer.h.0...``. So, with a config, the export's names are checked against the names of the
model the config describes (interop/ties.py builds it on the meta device), the way ``from_pretrained``
matches them (it adds or strips the model's ``base_model_prefix``):

- most names match: the export goes on (names that do not match are warned about);
- most do not, and stripping one prefix every name shares makes most match: that prefix is stripped,
  with a WARNING naming it (unless the caller gave ``strip_prefix``, which is then wrong: refused);
- otherwise the export is refused, naming the leading parts the names have, to pick with ``--strip-prefix``.

Without a config nothing can be checked; names that all begin with one common part are warned about.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from shardsafe.errors import InvalidArgumentError
from shardsafe.interop.ties import ModelInfo

logger = logging.getLogger(__name__)


def known(name: str, model: ModelInfo) -> bool:
    """Whether ``from_pretrained`` of ``model`` loads the weight saved as ``name``."""
    if name in model.names:
        return True
    base = model.base_prefix
    return bool(base) and (
        f"{base}.{name}" in model.names or (name.startswith(f"{base}.") and name[len(base) + 1 :] in model.names)
    )


def wrapper_prefix(names: Sequence[str], model: ModelInfo | None, *, where: str, key: str, given: str | None) -> str:
    """The prefix to strip from ``names`` (``""`` for none), or :class:`InvalidArgumentError` for names
    ``from_pretrained`` would ignore. ``given``: the caller's ``strip_prefix``, already applied."""
    if not names:
        return ""
    if model is None:
        shared = _shared(names)
        if shared and not given and len(names) > 1:
            logger.warning(
                "shardsafe export: every tensor name of %s [%s] begins with %r (e.g. %r), as a wrapper such as a "
                "LightningModule's self.%s names them, and from_pretrained would find none of its weights under "
                "them. Pass --strip-prefix %s (strip_prefix=) if so, or --config so the names are checked against "
                "the model",
                where,
                key,
                shared[0],
                names[0],
                shared[0].rstrip("."),
                shared[0],
            )
        return ""
    matched = sum(known(n, model) for n in names)
    if 2 * matched >= len(names):
        strays = [n for n in names if not known(n, model)]
        if strays:
            logger.warning(
                "shardsafe export: %d tensor name(s) of %s [%s] are not names %s has, and from_pretrained will "
                "ignore them: %s",
                len(strays),
                where,
                key,
                model.arch,
                ", ".join(strays[:5]) + (", ..." if len(strays) > 5 else ""),
            )
        return ""
    if not given:
        for prefix in _shared(names):
            stripped = [n[len(prefix) :] for n in names]
            if 2 * sum(known(n, model) for n in stripped) >= len(names):
                logger.warning(
                    "shardsafe export: the tensor names of %s [%s] all begin with %r (e.g. %r), a wrapper's prefix: "
                    "%s expects them without it, so it was stripped (pass --strip-prefix %s to say so, and silence "
                    "this warning)",
                    where,
                    key,
                    prefix,
                    names[0],
                    model.arch,
                    prefix,
                )
                return prefix
    parts = Counter(n.split(".", 1)[0] + "." for n in names if "." in n)
    shown = ", ".join(f"{p!r} ({c} tensors)" for p, c in parts.most_common(5))
    expected = sorted(model.names)[0] if model.names else "?"
    raise InvalidArgumentError(
        f"{where}: {len(names) - matched} of the {len(names)} tensor names of entry {key!r} are not names "
        f"{model.arch} has (e.g. {names[0]!r}, where it expects names like {expected!r}): from_pretrained would "
        "ignore them and initialise those weights at random, so nothing was exported. "
        + (
            f"The names begin with {shown}: pass --strip-prefix (strip_prefix=) with the one that holds the model "
            "(tensors outside it are left out), or pick a deeper --key"
            if parts
            else "Pick the entry that holds the model with --key"
        )
    )


def _shared(names: Sequence[str]) -> list[str]:
    """The prefixes ending in ``.`` that every name has and is longer than, shortest first."""
    out: list[str] = []
    parts = names[0].split(".")
    for k in range(1, len(parts)):
        prefix = ".".join(parts[:k]) + "."
        if all(n.startswith(prefix) and len(n) > len(prefix) for n in names):
            out.append(prefix)
        else:
            break
    return out
