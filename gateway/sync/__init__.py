"""What keeps this gateway in step with others: the lanes' load (their agents' /slots reads) into the counts, prefix
entries shared with the other gateways, every gateway's token usage, and hot lanes asked to
spread their conversations."""

from gateway.sync.hot_spots import HotSpots
from gateway.sync.shared_view import SharedView
from gateway.sync.slots import SlotsFeed
from gateway.sync.usage import share_usage

__all__ = ["HotSpots", "SharedView", "SlotsFeed", "share_usage"]
