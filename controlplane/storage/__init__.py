"""The storage schema (SQLModel tables, defined once here), the engine factory and migrations."""
