"""Prefect tasks, one module per pipeline stage, each a thin wrapper over a plain, testable core."""
