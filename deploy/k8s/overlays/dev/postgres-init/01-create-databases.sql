-- Run by the postgres image's entrypoint as POSTGRES_USER (outbox) the
-- first time the data directory is initialised. The services create their
-- own tables (migrations at start-up); the databases must exist.
CREATE DATABASE outbox_orders;
CREATE DATABASE outbox_billing;
-- The audit consumer's (subscription audit).
CREATE DATABASE outbox_audit;
