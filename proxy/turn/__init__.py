"""The heart: which generation a request joins, and the one writer per client."""
