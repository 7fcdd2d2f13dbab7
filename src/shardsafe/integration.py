"""What the Lightning integrations share: :mod:`shardsafe.fabric` (Fabric's strategies) and
:mod:`shardsafe.lightning` (the Trainer's) both extend Lightning's own strategy classes with the mixin
:class:`StrategyCheckpoints`, which holds the options every shardsafe strategy takes and checks:

- ``checkpoint_timeout``: seconds every checkpoint wait may take (a property, changeable between saves);
- ``checkpoint_overwrite`` (default True, as Lightning overwrites a file): a committed checkpoint at the path
  is replaced atomically, anything that is not a shardsafe checkpoint is refused untouched;
- a ``CheckpointIO`` plugin, which would never be called, refused when the strategy is made or given one
  (:meth:`StrategyCheckpoints._accept_checkpoint_io` decides; the Trainer's strategies take Lightning's
  ``AsyncCheckpointIO`` as a request for asynchronous saves);
- the registration under each name Lightning registers the extended strategy with, prefixed ``shardsafe_``;

and two checks of their own: a ``torch.save`` file given to a load (:func:`refuse_pickle_file`) and FSDP's
``state_dict_type`` (:func:`check_state_dict_type`).

Layer: above the engine (it calls nothing of it), below ``fabric`` and ``lightning``. Imports Lightning's
``CheckpointIO`` type only for annotations; ``import shardsafe`` never imports this module.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, TypeVar

from shardsafe.deadline import Deadlines
from shardsafe.errors import CheckpointNotFoundError, InvalidArgumentError, InvalidTypeError

__all__ = ["StrategyCheckpoints", "check_state_dict_type", "expose_signature", "refuse_pickle_file"]

S = TypeVar("S", bound=type)


class StrategyCheckpoints:
    """Mixed in before a Lightning strategy class (Fabric's or the Trainer's): the checkpoint options
    every shardsafe strategy takes (module docstring). Subclasses add the save and load methods."""

    _checkpoint_timeout: float | Deadlines | None
    _checkpoint_overwrite: bool
    _framework = "Lightning"
    """The framework the strategy belongs to, in messages (``Fabric``, ``Lightning``)."""

    def __init__(
        self,
        *args: Any,
        checkpoint_timeout: float | Deadlines | None = None,
        checkpoint_overwrite: bool = True,
        **kwargs: Any,
    ) -> None:
        """The strategy's own arguments, plus ``checkpoint_timeout`` and ``checkpoint_overwrite``."""
        super().__init__(*args, **kwargs)
        self._init_checkpoints(checkpoint_timeout, checkpoint_overwrite)
        self._check_options()

    def _init_checkpoints(self, timeout: float | Deadlines | None, overwrite: bool) -> None:
        if not isinstance(overwrite, bool):
            raise InvalidTypeError(f"checkpoint_overwrite must be True or False, not {overwrite!r}")
        self.checkpoint_timeout = timeout
        self._checkpoint_overwrite = overwrite

    def _check_options(self) -> None:
        """Refuse the options this strategy would silently ignore."""
        io = getattr(self, "_checkpoint_io", None)  # Lightning's Strategy keeps checkpoint_io= there
        if io is not None:
            self._accept_checkpoint_io(io)

    def _accept_checkpoint_io(self, io: Any) -> None:
        """A ``CheckpointIO`` plugin given to the strategy: refused (it would never be called)."""
        raise InvalidArgumentError(
            f"the CheckpointIO plugin {type(io).__name__} would never be called: {type(self).__module__}."
            f"{type(self).__name__} writes and reads every checkpoint through shardsafe. Remove it (plugins= or "
            f"checkpoint_io=); for remote paths pass storage_options= to the save, or use {self._framework}'s own "
            "strategy to keep the plugin."
        )

    @property
    def checkpoint_io(self) -> Any:
        """Lightning's (unused by checkpoints: the default plugin; FSDP and ModelParallel may raise, as in
        Lightning)."""
        return super().checkpoint_io  # type: ignore[misc]

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._accept_checkpoint_io(io)  # Lightning sets a plugins= CheckpointIO here

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register this class under each name Lightning registers the strategy it extends with, prefixed
        ``shardsafe_`` and with the same arguments (``shardsafe_ddp``, ``shardsafe_ddp_spawn``...)."""
        lightning_names = type(strategy_registry)()
        super().register_strategies(lightning_names)  # type: ignore[misc]
        for name, data in lightning_names.items():
            description = f"{data['description']}; checkpoints through shardsafe".lstrip("; ")
            strategy_registry.register(
                f"shardsafe_{name}", data["strategy"], description=description, override=True, **data["init_params"]
            )

    @property
    def checkpoint_timeout(self) -> float | Deadlines | None:
        """Seconds each checkpoint wait may take (ranks arriving, writes, commit); None: the
        ``SHARDSAFE_TIMEOUT``/``SHARDSAFE_IO_TIMEOUT`` defaults. May be changed between saves."""
        return self._checkpoint_timeout

    @checkpoint_timeout.setter
    def checkpoint_timeout(self, timeout: float | Deadlines | None) -> None:
        seconds = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
        if not (timeout is None or isinstance(timeout, Deadlines) or seconds):
            raise InvalidArgumentError(
                f"checkpoint_timeout must be a positive number of seconds or None, not {timeout!r}"
            )
        self._checkpoint_timeout = timeout


def refuse_pickle_file(path: str | os.PathLike[str]) -> None:
    """A ``torch.save`` file is not a shardsafe checkpoint, and loading it would unpickle it."""
    p = os.fspath(path)
    if "://" not in p and os.path.isfile(p):
        raise CheckpointNotFoundError(
            f"{p} is a file, not a shardsafe checkpoint (a directory). shardsafe never unpickles; convert a "
            "trusted torch.save file once with shardsafe.save(new_path, torch.load(path, weights_only=True))."
        )


def check_state_dict_type(kind: Any) -> None:
    """FSDP's ``state_dict_type`` must be one of Lightning's values; shardsafe writes each rank's shard
    whichever it is."""
    if kind not in ("full", "sharded"):
        raise InvalidArgumentError(
            f"state_dict_type={kind!r} must be 'full' or 'sharded', as in Lightning's FSDPStrategy; shardsafe "
            "writes each rank's shard either way (no gather), and the checkpoint loads into any strategy and "
            "world size"
        )


def expose_signature(cls: S) -> S:
    """Give a shardsafe strategy class the signature of the Lightning strategy it extends plus the mixins'
    keyword-only options (``inspect.signature(cls)``, ``cls.__init__``), so that tools that read it
    (LightningCLI, jsonargparse) see ``find_unused_parameters``, ``device_mesh``... and not ``*args, **kwargs``."""
    mixins = [c for c in cls.__mro__ if issubclass(c, StrategyCheckpoints) and "__init__" in vars(c)]
    base = next(c for c in cls.__mro__[1:] if not issubclass(c, StrategyCheckpoints) and "__init__" in vars(c))
    theirs = list(inspect.signature(base.__init__).parameters.values())
    ours: dict[str, inspect.Parameter] = {}
    for mixin in mixins:
        for p in inspect.signature(vars(mixin)["__init__"], eval_str=True).parameters.values():
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in ours:
                ours[p.name] = p
    head = [p for p in theirs if p.kind is not inspect.Parameter.VAR_KEYWORD]
    tail = [p for p in theirs if p.kind is inspect.Parameter.VAR_KEYWORD]
    params = [*head, *(p for n, p in ours.items() if n not in {q.name for q in head}), *tail]
    mixin_init = vars(mixins[0])["__init__"]  # the most derived mixin's

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        mixin_init(self, *args, **kwargs)

    __init__.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    __init__.__doc__ = mixin_init.__doc__
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = __init__  # type: ignore[misc]
    cls.__signature__ = inspect.Signature(params[1:])  # type: ignore[attr-defined]  # without self
    return cls
