"""The ``shardsafe`` command (also ``python -m shardsafe``): ``main`` parses and dispatches
(:mod:`~shardsafe.cli.main`: inspect, verify), listing (:mod:`~shardsafe.cli.ls`), export and import
(:mod:`~shardsafe.cli.interop`), the exit status (:mod:`~shardsafe.cli.status`). Torch and the rest of
the library are imported inside the commands that need them, so ``--help`` answers at once.

Layer: the top; imports anything below, nothing imports it but ``__main__``."""

from shardsafe.cli.main import main

__all__ = ["main"]
