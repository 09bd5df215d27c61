"""A generation's events on Redis, for followers in other processes."""
