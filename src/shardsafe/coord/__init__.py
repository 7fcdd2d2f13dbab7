"""Cross-rank coordination through the rendezvous store, and fault injection points.

The only package that touches the store (``torch.distributed.Store``), through one client whose every
request is bounded by a deadline (``client``). An operation (``operation``) is a short sequence of
agreements (``agreement``): every rank sends a typed message (``messages``), rank 0 decides, every rank
gets the same outcome, or raises the same failure (``failures``: errors keep their kind across ranks).
A watchdog per process ticks a heartbeat and finds dead ranks and a lost store (``liveness``). Also
here: group resolution and the user's call site (``resolve``), the manager's per-step agreements
(``steps``), progress keys (``progress``) and fault injection (``faults``).

Layer: imports only :mod:`shardsafe.errors`, :mod:`shardsafe.knobs`, :mod:`shardsafe.deadline`,
:mod:`shardsafe.workers` (and torch); every layer above may import it."""

from shardsafe.coord.faults import POINTS, InjectedFault, fault_point
from shardsafe.coord.operation import Operation, rendezvous
from shardsafe.coord.resolve import call_site
from shardsafe.deadline import Clock, Deadline, Deadlines

__all__ = [
    "POINTS",
    "Clock",
    "Deadline",
    "Deadlines",
    "InjectedFault",
    "Operation",
    "call_site",
    "fault_point",
    "rendezvous",
]
