"""The fleet as this gateway knows it: the lanes the bus says are planned and healthy, and the
verdict on a lane's own /health probe. Every other room names lanes with these."""

from gateway.fleet.probe import Outcome, judge, this_round
from gateway.fleet.view import FleetView, LaneKey, LaneRoute

__all__ = ["FleetView", "LaneKey", "LaneRoute", "Outcome", "judge", "this_round"]
