"""Cross-rank coordination through the rendezvous store, and fault injection points."""

from shardsafe.coord.faults import POINTS, InjectedFault, fault_point
from shardsafe.coord.group import Coordinator, Deadlines, call_site

__all__ = ["POINTS", "Coordinator", "Deadlines", "InjectedFault", "call_site", "fault_point"]
