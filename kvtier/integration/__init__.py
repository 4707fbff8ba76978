"""Integrations of kvtier into serving engines (imported only by the engine that needs one)."""
