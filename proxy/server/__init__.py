"""The ASGI app, the proxy endpoint, serving, the accept loop, shutdown."""
