"""The lanes gateway: one OpenAI-compatible door to every lane of the fleet.

Layers (arrows point down): service (NATS + serving) -> http (aiohttp edge) ->
admission (route choice, bounded queue) -> fleet (the view of plans and status).
"""
