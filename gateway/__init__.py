"""The lanes gateway: one OpenAI-compatible door to every lane of the fleet.

Rooms, each entered through its __init__ (arrows point down): service (NATS, loops, wiring) ->
dashboard -> edge (HTTP) -> sync (in step with lanes and gateways) -> admission (slots, queue,
holds) -> routing, tenants (pure decisions) -> fleet (the bus's facts); settings and refusals
are the words every room shares. docs/development.md has the table.
"""
