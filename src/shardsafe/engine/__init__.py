"""The engine: one save from plan to commit, one load from manifest to restore.

Lives here: the public functions (``api``: save, async_save, load) and the one definition of a
save's keyword options (``options``: ``SaveOptions``), the saves in flight and the exit hook
(``inflight``), the write plan and its ``PendingChunk`` (``plan``), one save's job (``save``) and
its commit decision, publish and acknowledgement (``commit``), staging through pinned host memory
(``staging``, ``hostmem``), the load (``load``), read planning and the reader threads (``read``),
what a folder without a manifest is, for the error that says so (``not_found``), verify and inspect
(``inspect``), the error mapping of the read side (``guard``), the memory check of a load
(``memory``), the DEBUG phase log (``phases``), progress records, their tracking and the bar
(``progress``, ``tracker``, ``progressbar``).

Layer: may import state, format, storage, coord, knobs, errors; imported by manager, interop,
runtime, fabric and the public package. docs/architecture.md walks one save and one load through it."""
