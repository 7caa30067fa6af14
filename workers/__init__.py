"""Code that runs on every node: fingerprint, measure, simulate. Never touches the database."""
