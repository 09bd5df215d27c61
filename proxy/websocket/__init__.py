"""The Responses WebSocket mode: upgrades, sessions, fencing per response."""
