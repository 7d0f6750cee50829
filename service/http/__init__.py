"""The HTTP layer of the service: FastAPI/ASGI routes in front of one engine."""
