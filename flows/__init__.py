"""Prefect flows: the pipeline read top to bottom; the work lives in `tasks/`."""
