"""The live dashboard: one static page fed by a stream of the fleet's state and lane events."""

from gateway.dashboard.hub import DashboardHub, add_dashboard

__all__ = ["DashboardHub", "add_dashboard"]
