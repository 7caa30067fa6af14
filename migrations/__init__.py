"""Alembic migrations of the results database (own version table: Optuna keeps its own)."""

from pathlib import Path

SCRIPT_LOCATION = str(Path(__file__).parent)
VERSION_TABLE = "fleettune_alembic_version"
