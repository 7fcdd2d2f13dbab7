"""Cross-rank coordination through the rendezvous store, and fault injection points.

The only package that touches the store (``torch.distributed.Store``): rendezvous and barriers
(``group``), store access and diagnostics (``access``), the one wait loop (``waiting``), heartbeats
(``liveness``), decisions, posted values and acknowledgements (``outcome``), abort records
(``failures``), key cleanup (``housekeeping``), group resolution (``resolve``), deadlines
(``deadlines``), shardsafe's own store connection (``connection``), the manager's per-step agreements
(``agreement``) and fault injection (``faults``).

Layer: imports only :mod:`shardsafe.errors` and :mod:`shardsafe.knobs` (and torch); every layer above
(storage, format, state, engine, manager, runtime, interop, cli) may import it."""

from shardsafe.coord.deadlines import Deadlines
from shardsafe.coord.faults import POINTS, InjectedFault, fault_point
from shardsafe.coord.group import Coordinator
from shardsafe.coord.resolve import call_site

__all__ = ["POINTS", "Coordinator", "Deadlines", "InjectedFault", "call_site", "fault_point"]
