"""The SQL store: ORM models (apart from the pydantic schemas), engine/session setup, data-access functions."""
