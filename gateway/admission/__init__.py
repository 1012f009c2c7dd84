"""When a request may go: a slot on the lane routing chose, or a place in a bounded, fair queue,
or a hold while its model loads; and the counts of what each lane is doing."""

from gateway.admission.counts import LaneCounts
from gateway.admission.lease import Lease
from gateway.admission.queue import Admission
from gateway.admission.waking import (
    HeldFull, LoadFailed, LoadTimeout, ModelView, Waker, activity, catalogue, classify, only_model, persona_of,
)

__all__ = [
    "Admission", "HeldFull", "LaneCounts", "Lease", "LoadFailed", "LoadTimeout", "ModelView", "Waker",
    "activity", "catalogue", "classify", "only_model", "persona_of",
]  # fmt: skip
