"""Pure, I/O-free: the bytes and rules of each API (SSE, dialects, turn keys, codings)."""
