"""Cross-rank coordination through the rendezvous store, and fault injection points.

The only package that touches the store (``torch.distributed.Store``), through one client whose every
request is bounded by a deadline (``client``); ``tests/test_store_access.py`` checks that no code
outside it makes a store request. The protocol engine (``operation``): an operation is a short sequence
of rounds its caller declares once (``rounds``: what every rank sends, what is decided, who decides),
run as agreements (``agreement``) or as decide-act-confirm (``commitment``) over the keys and requests
of ``wire`` and the state of ``session``, with typed messages (``messages``); every rank gets the same
typed outcome or raises the same failure (``failures``: errors keep their kind across ranks), then
acknowledges it (``ending``). Also here: per-rank counters (``counters``, for progress), a watchdog per
process that ticks a heartbeat and finds dead ranks and a lost store (``liveness``), group resolution
and the user's call site (``resolve``), per-step broadcasts outside operations (``steps``) and fault
injection (``faults``). It knows none of its callers' rounds or messages: those live with their callers
(``engine/messages.py``, ``manager/messages.py``).

Layer: imports only :mod:`shardsafe.errors`, :mod:`shardsafe.knobs`, :mod:`shardsafe.deadline`,
:mod:`shardsafe.workers` (and torch); every layer above may import it."""

from shardsafe.coord.faults import POINTS, InjectedFault, fault_point
from shardsafe.coord.messages import Empty, Message
from shardsafe.coord.operation import Operation, rendezvous
from shardsafe.coord.resolve import call_site
from shardsafe.coord.rounds import Broadcast, Commitment, Round
from shardsafe.deadline import Clock, Deadline, Deadlines

__all__ = [
    "POINTS",
    "Broadcast",
    "Clock",
    "Commitment",
    "Deadline",
    "Deadlines",
    "Empty",
    "InjectedFault",
    "Message",
    "Operation",
    "Round",
    "call_site",
    "fault_point",
    "rendezvous",
]
