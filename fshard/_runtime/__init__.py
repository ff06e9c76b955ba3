"""The runtime: the only place module, autograd and optimizer hooks are installed, and the\nper-tree root context the units talk to (see docs/architecture.md)."""
