"""The node's HTTP server: one aiohttp app on ``--http-port`` for the management API, the UI and the
health checks (DESIGN: "Ports, flags and where new parts live").

Each concern is a module with ``register(app: web.Application, node) -> None`` that adds its routes;
``server.ROUTE_MODULES`` lists them, so a new module is one line there and never touches another's
routes. Handlers reach the node through ``app[NODE_KEY]``.
"""
