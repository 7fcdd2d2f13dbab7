"""The engine: one save from plan to commit, one load from manifest to restore.

Lives here: the public functions (``api``: save, async_save, load) and the one definition of a
save's keyword options (``options``: ``SaveOptions``), the saves in flight and the exit hook
(``inflight``), the write plan and its ``PendingChunk`` (``plan``), one save's job (``save``) and
its commit decision, publish and acknowledgement (``commit``), the failed saves of this process whose
files could not be removed, for the next save to remove (``unremoved``), the host buffers a save copies into
(``staging``, ``hostmem``), the load (``load``), read planning and the reader threads (``read``),
verify and inspect (``inspect``), the one error wrapper of every entry point (``guard``), the memory
check of a load (``memory``) and the DEBUG phase log (``phases``).

Layer: may import progress, state, catalog, format, storage, coord, workers, deadline, knobs, errors;
imported by manager, interop, runtime, fabric and the public package. docs/architecture.md walks one
save and one load through it."""
