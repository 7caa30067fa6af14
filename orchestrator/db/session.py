"""Opening the results database: URL, engine, schema version checks.

SQLite (WAL, busy timeout) is the embedded default under the user's data directory; any SQLAlchemy
URL works, ``postgresql+psycopg://`` for a fleet. A fresh database is created on first use; one at
an older schema is never silently altered (``fleettune db upgrade`` does that, on request).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from migrations import SCRIPT_LOCATION, VERSION_TABLE
from orchestrator.db.models import Base
from workers.errors import BadInput
from workers.paths import data_dir

SQLITE_BUSY_TIMEOUT_S = float(os.environ.get("FLEETTUNE_SQLITE_BUSY_TIMEOUT_S", "30"))
# how long a study keeps retrying a database that does not answer (a restart, a long lock)
DB_RETRY_WINDOW_S = float(os.environ.get("FLEETTUNE_DB_RETRY_S", "60"))


class DatabaseUnavailable(Exception):
    """The database did not answer within the retry window."""


def is_transient(exc: BaseException, conflicts: bool = False) -> bool:
    """A failure that a later attempt may not meet: a lost connection, a restart, a lock; with
    ``conflicts``, also a unique row another writer inserted first (the next attempt reads it)."""
    from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError

    if isinstance(exc, OperationalError | InterfaceError):
        return True
    if conflicts and isinstance(exc, IntegrityError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def retrying(attempt, *, window_s: float | None = None, should_stop=lambda: False, on_retry=None,
             conflicts: bool = False):
    """``attempt()``, again with backoff while it fails transiently, for at most ``window_s``.

    Each attempt must be a whole transaction (its own session), so a failed one leaves nothing.
    Raises ``DatabaseUnavailable`` when the window is over or ``should_stop()`` says so.
    """
    import time

    window = DB_RETRY_WINDOW_S if window_s is None else window_s
    deadline = time.monotonic() + window
    delay = 0.1
    while True:
        try:
            return attempt()
        except Exception as exc:
            if not is_transient(exc, conflicts):
                raise
            left = deadline - time.monotonic()
            if left <= 0 or should_stop():
                raise DatabaseUnavailable(f"the database did not answer for {window:g}s: "
                                          f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
            if on_retry:
                on_retry(exc)
            time.sleep(min(delay, left))  # backoff between attempts, not a synchronisation
            delay = min(delay * 2, 2.0)


def default_db_url() -> str:
    return os.environ.get("FLEETTUNE_DB") or f"sqlite:///{data_dir() / 'fleettune.db'}"


def _secret_key(key: str) -> bool:
    """A query parameter that carries a password (psycopg takes ``?password=``; issue 24, case 11)."""
    return any(word in key.lower() for word in ("password", "passwd", "pwd", "secret", "sslpassword"))


def redact(url: str | URL) -> str:
    """The URL without its password (in the URL's user part or as a query parameter), for messages and logs."""
    try:
        parsed = make_url(url)
        if any(_secret_key(k) for k in parsed.query):
            parsed = parsed.set(query={k: ("***" if _secret_key(k) else v) for k, v in parsed.query.items()})
        return parsed.render_as_string(hide_password=True).replace("=%2A%2A%2A", "=***")
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        return "<unparseable URL>"


def _parse(url: str) -> URL:
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        raise BadInput(f"bad database URL {redact(url)!r}: expected e.g. sqlite:///path.db") from None
    if parsed.drivername == "postgresql":  # psycopg 3 is the driver fleettune ships with
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite" and (
            parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory"
            or str(parsed.database).startswith("file::memory:")):
        raise BadInput(f"database URL {redact(url)!r} is an in-memory SQLite database: everything written "
                       "vanishes at exit; name a file, e.g. sqlite:///results.db")
    return parsed


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def engine_kwargs(url: URL) -> dict:
    """Engine options fleettune uses for a URL (shared with Optuna's storage)."""
    if url.get_backend_name() == "sqlite":
        return {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}}
    return {"pool_pre_ping": True}


def make_engine(url: str | URL) -> Engine:
    parsed = _parse(str(url) if isinstance(url, str) else url.render_as_string(hide_password=False))
    if parsed.get_backend_name() == "sqlite":
        parent = Path(parsed.database).expanduser().parent
        if not parent.is_dir():
            raise BadInput(f"bad database URL {redact(parsed)!r}: folder {parent} does not exist")
    try:
        engine = create_engine(parsed, **engine_kwargs(parsed))
    except (ArgumentError, NoSuchModuleError, ImportError) as exc:
        raise BadInput(f"bad database URL {redact(parsed)!r}: {exc}") from None
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def alembic_config(connection=None) -> Config:
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def is_known_revision(revision: str) -> bool:
    """Whether this fleettune's migrations know ``revision`` (a newer fleettune's are unknown here)."""
    from alembic.util import CommandError

    try:
        return ScriptDirectory.from_config(alembic_config()).get_revision(revision) is not None
    except (CommandError, KeyError, ValueError):  # alembic's ResolutionError is a CommandError
        return False


def newer_schema_message(display_url: str, current: str) -> str:
    """The one line for a schema this fleettune does not know: made by a newer fleettune
    (issue 24, case 11: never "run db upgrade", which cannot go forward from there)."""
    return (f"database {display_url} is at schema {current}, which this fleettune does not know "
            f"(it needs {head_revision()}): it was made by a newer fleettune; use that version")


def no_version_message(display_url: str) -> str:
    return (f"database {display_url} has fleettune tables but no schema version; "
            "it was not made by fleettune (or its version row was removed), so it cannot be upgraded")


def refuse_unstorable(session: Session, _context, _instances) -> None:
    """Before any row is written: a text value PostgreSQL would refuse is BadInput on every backend
    (SQLite stores it silently): a NUL character, or more characters than its column holds (issue 24).
    The transaction is rolled back, so nothing is written."""
    from sqlalchemy import String
    from sqlalchemy import inspect as inspect_object

    for obj in [*session.new, *session.dirty]:
        state = inspect_object(obj)
        mapper = state.mapper
        for attr in mapper.column_attrs:
            value = state.dict.get(attr.key)  # what is loaded or set; never a load of its own
            if not isinstance(value, str):
                continue
            what = f"{mapper.class_.__name__.lower()} {attr.key}"
            if "\x00" in value:
                raise BadInput(f"{what} holds a NUL character, which the database cannot store")
            length = getattr(attr.columns[0].type, "length", None)
            if isinstance(attr.columns[0].type, String) and length and len(value) > length:
                raise BadInput(f"{what} is {len(value)} characters long; the database holds at most {length}")


class Database:
    """An open results database: engine + session factory, schema checked."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.url = engine.url
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        event.listen(self.sessions, "before_flush", refuse_unstorable)

    @property
    def url_string(self) -> str:
        """The full URL (password included) for other libraries such as Optuna's storage."""
        return self.url.render_as_string(hide_password=False)

    @property
    def display_url(self) -> str:
        return redact(self.url)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction: committed on success, rolled back on any error."""
        with self.sessions() as session, session.begin():
            yield session

    def current_revision(self) -> str | None:
        with self.engine.connect() as conn:
            return MigrationContext.configure(
                conn, opts={"version_table": VERSION_TABLE}
            ).get_current_revision()

    def has_our_tables(self) -> bool:
        existing = set(inspect(self.engine).get_table_names())
        return bool(existing & set(Base.metadata.tables))

    def upgrade(self) -> tuple[str | None, str]:
        """Bring the schema to the newest revision; returns (before, after). A schema this
        fleettune does not know, or tables without a version row, are BadInput, nothing changed."""
        before = self.current_revision()
        if before is not None and not is_known_revision(before):
            raise BadInput(newer_schema_message(self.display_url, before))
        if before is None and self.has_our_tables():
            raise BadInput(no_version_message(self.display_url))
        with self.engine.begin() as conn:
            command.upgrade(alembic_config(conn), "head")
        return before, self.current_revision() or ""

    def dispose(self) -> None:
        self.engine.dispose()


def open_database(url: str | None = None, *, create: bool = True, check: bool = True) -> Database:
    """Open (and on first use create) the database; refuse one at another schema version."""
    url = url or default_db_url()
    if url == default_db_url() and not os.environ.get("FLEETTUNE_DB"):
        try:
            data_dir().mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInput(f"cannot create the data folder {data_dir()}: {exc.strerror or exc}") from None
    db = Database(make_engine(url))
    try:
        if not check:
            with db.engine.connect():
                pass
            return db
        current = db.current_revision()
        head = head_revision()
        if current == head:
            return db
        if current is None and not db.has_our_tables() and create:
            db.upgrade()
            return db
        db.dispose()
        if current is None:
            raise BadInput(no_version_message(db.display_url))
        if not is_known_revision(current):
            raise BadInput(newer_schema_message(db.display_url, current))
        raise BadInput(
            f"database {db.display_url} is at schema {current}, this fleettune needs {head}; "
            "run `fleettune db upgrade` (back it up first)"
        )
    except SQLAlchemyError as exc:
        db.dispose()
        reason = str(exc.orig if getattr(exc, "orig", None) else exc).strip().splitlines()[0]
        raise BadInput(f"cannot open database {db.display_url}: {reason}") from None
    except (ValueError, OSError) as exc:  # a driver refusing the URL itself, e.g. a NUL in a path
        db.dispose()
        raise BadInput(f"cannot open database {db.display_url}: {exc}") from None
