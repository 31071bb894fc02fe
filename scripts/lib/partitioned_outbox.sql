-- For the bench's retention phase only (scripts/bench): the migrated,
-- empty outbox of a fresh database made into the first child of a parent
-- partitioned by seq range, as rotation would need, so that the producer's
-- statement can be timed against it. PostgreSQL 15 has no identity column
-- on a partitioned table, so seq draws from a plain sequence of the same
-- name (the writer calls nextval('outbox_seq_seq') itself). event_id is
-- unique only within a child; outbox_event_id_free is the check a
-- caller-given id would need across children: an advisory lock on the id,
-- then a probe of every child's index in a snapshot taken after the lock
-- (each statement of a VOLATILE function takes its own in READ COMMITTED).
BEGIN;
LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE;
SELECT coalesce(max(seq), 0) + 1 AS next FROM outbox \gset
ALTER TABLE outbox RENAME TO outbox_c0;
DROP TRIGGER outbox_fan_out ON outbox_c0;
ALTER TABLE outbox_c0 ALTER COLUMN seq DROP IDENTITY;
CREATE SEQUENCE outbox_seq_seq START :next;
CREATE TABLE outbox (LIKE outbox_c0 INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
  PARTITION BY RANGE (seq);
ALTER TABLE outbox ADD PRIMARY KEY (seq);
CREATE INDEX outbox_parted_xid_idx ON outbox (xid, seq);
CREATE INDEX outbox_parted_event_id_idx ON outbox (event_id);
ALTER TABLE outbox ATTACH PARTITION outbox_c0 FOR VALUES FROM (MINVALUE) TO (:next);
CREATE TABLE outbox_c1 PARTITION OF outbox FOR VALUES FROM (:next) TO (:next + 1000000);
CREATE TABLE outbox_c2 PARTITION OF outbox FOR VALUES FROM (:next + 1000000) TO (:next + 2000000);
CREATE TABLE outbox_c3 PARTITION OF outbox FOR VALUES FROM (:next + 2000000) TO (:next + 3000000);
CREATE TRIGGER outbox_fan_out AFTER INSERT ON outbox
  REFERENCING NEW TABLE AS new_events
  FOR EACH STATEMENT EXECUTE FUNCTION outbox_fan_out();
CREATE FUNCTION outbox_event_id_free(id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  PERFORM pg_advisory_xact_lock(hashtextextended(id::text, 0));
  IF EXISTS (SELECT 1 FROM outbox WHERE event_id = id) THEN
    RAISE unique_violation USING MESSAGE = format('event_id %s is in the outbox already', id);
  END IF;
  RETURN true;
END $$;
COMMIT;
