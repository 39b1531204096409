"""Integrations with training frameworks (imported on demand: they need the framework installed)."""
