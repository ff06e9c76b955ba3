"""One unit of sharding: a module's parameter group and what acts on it alone."""
