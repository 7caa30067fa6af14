"""The results database: the only package that talks SQL."""

from orchestrator.db.session import Database, default_db_url, open_database

__all__ = ["Database", "default_db_url", "open_database"]
