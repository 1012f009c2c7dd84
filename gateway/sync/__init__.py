"""What keeps this gateway in step with others: the lanes' /slots read into the counts, prefix
entries shared with the other gateways, and every gateway's token usage."""

from gateway.sync.shared_view import SharedView
from gateway.sync.slots import SlotsPoll
from gateway.sync.usage import share_usage

__all__ = ["SharedView", "SlotsPoll", "share_usage"]
