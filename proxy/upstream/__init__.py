"""Talking to providers: the HTTP client and transport, routing, egress."""
