"""One unit: its parameter group, its reduce pipeline, its gradient hooks and registry\n(see docs/architecture.md)."""
