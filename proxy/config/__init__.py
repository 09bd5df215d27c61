"""The configuration: its schema, loading (TOML, environment, flags) and checks."""
