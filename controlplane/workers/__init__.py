"""Background workers. Replicas coordinate only through PostgreSQL."""
