"""Alembic environment: runs on the connection fleettune hands it, with its own version table."""

from alembic import context
from sqlalchemy import engine_from_config, pool

from migrations import VERSION_TABLE
from orchestrator.db.models import Base

config = context.config
target_metadata = Base.metadata


def include_object(obj, name, type_, reflected, compare_to):
    """Only our tables: Optuna's share the database and are migrated by Optuna."""
    if type_ == "table":
        return name in target_metadata.tables
    return True


def run_migrations(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        include_object=include_object,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run_migrations(connection)
else:
    engine = engine_from_config(
        config.get_section(config.config_ini_section, {}),
        prefix="sqlalchemy.",
        poolclass=pool.NullPool,
    )
    with engine.connect() as conn:
        run_migrations(conn)
