#include "common/schema.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace outbox {

namespace {

// Both schemas keep the identity of the database they live in (one table
// when they share a database): a binary that starts after a failover or a
// restore still sees that the database changed under it.
#define OUTBOX_DATABASE_IDENTITY_SQL                          \
  "CREATE TABLE IF NOT EXISTS outbox_database_identity (\n"   \
  "  id          int PRIMARY KEY DEFAULT 1 CHECK (id = 1),\n" \
  "  identity    text NOT NULL,\n"                            \
  "  recorded_at timestamptz NOT NULL DEFAULT now()\n"        \
  ");\n"

constexpr char kDeliveriesViewHead[] = R"sql(
CREATE OR REPLACE VIEW outbox_deliveries AS
  SELECT s.name AS subscription, o.seq, o.event_id, o.aggregate_id,
         o.event_type, o.created_at,
)sql";
// The view outbox_deliveries after its status column. Migration 1 made it
// with the status of its time (before the log), migration 7 with the log's
// (a function call per event), migration 9 with kDeliveryStatusSql and
// its joins (kDeliveryLogJoinsSql).
constexpr char kDeliveryStatusV1Sql[] =
    "coalesce(d.status, CASE WHEN o.seq < s.start_seq THEN 'skipped' "
    "ELSE 'delivered' END)";
constexpr char kDeliveryStatusV7Sql[] =
    "coalesce(d.status, CASE WHEN o.seq < s.start_seq THEN 'skipped' "
    "WHEN s.start_tick IS NOT NULL AND outbox_log_owed(s.name, o.seq, o.xid, "
    "o.partition) THEN 'pending' ELSE 'delivered' END)";
constexpr char kDeliveriesViewFrom[] = R"sql( AS status,
         coalesce(d.attempts, 0) AS attempts, d.last_error, d.available_at,
         d.dead_at
    FROM outbox o CROSS JOIN subscriptions s
    LEFT JOIN outbox_delivery d ON d.subscription = s.name AND d.seq = o.seq)sql";

constexpr char kOutboxV3[] = R"sql(
-- Partition ownership by lease: a row per (subscription, partition), owned
-- by a relay until expires_at, renewed each second. Nothing of it lives in
-- a database session, so it works behind a transaction pooler, and a relay
-- that freezes loses its partitions when its leases run out; token grows
-- with every change of owner (a fencing token).
CREATE TABLE IF NOT EXISTS outbox_partition_leases (
  subscription text COLLATE "C" NOT NULL,
  partition    int NOT NULL,
  owner        text,
  token        bigint NOT NULL DEFAULT 0,
  expires_at   timestamptz NOT NULL DEFAULT '-infinity',
  PRIMARY KEY (subscription, partition)
) WITH (fillfactor = 50);
-- The relays of each subscription that are alive (their lease on
-- membership), which sets each one's share of the partitions.
CREATE TABLE IF NOT EXISTS outbox_relay_members (
  subscription text COLLATE "C" NOT NULL,
  member       text NOT NULL,
  expires_at   timestamptz NOT NULL,
  PRIMARY KEY (subscription, member)
) WITH (fillfactor = 50);

-- A third state of a delivery: the consumer applied a different history of
-- the event's aggregate (DIVERGED); it waits, with its aggregate, for an
-- operator (RelayAdmin.ResolveDivergence). No attempt is counted.
ALTER TABLE outbox_delivery DROP CONSTRAINT IF EXISTS outbox_delivery_status_check;
ALTER TABLE outbox_delivery ADD CONSTRAINT outbox_delivery_status_check
  CHECK (status IN ('pending', 'dead', 'diverged'));

-- Aggregates whose producer and consumer histories diverged, one open row
-- per subscription and aggregate, kept once resolved (who, why, what the
-- consumer had).
CREATE TABLE IF NOT EXISTS outbox_divergences (
  id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  subscription      text COLLATE "C" NOT NULL,
  aggregate_id      text COLLATE "C" NOT NULL,
  kind              text NOT NULL,
  detail            text NOT NULL,
  detected_at       timestamptz NOT NULL DEFAULT now(),
  consumer_seq      bigint,
  consumer_event_id uuid,
  outbox_seq        bigint,
  outbox_event_id   uuid,
  resolved_at       timestamptz,
  resolved_by       text,
  resolution        text
);
CREATE UNIQUE INDEX IF NOT EXISTS outbox_divergences_open_idx
  ON outbox_divergences (subscription, aggregate_id) WHERE resolved_at IS NULL;

-- The consumer's database as the subscription's relays last saw it, and a
-- heal (compare the consumer's cursors with what was delivered, deliver
-- again what it lost) requested when either database changed.
ALTER TABLE subscriptions
  ADD COLUMN IF NOT EXISTS consumer_identity text,
  ADD COLUMN IF NOT EXISTS heal_requested_at timestamptz,
  ADD COLUMN IF NOT EXISTS heal_reason text,
  ADD COLUMN IF NOT EXISTS healed_at timestamptz;
)sql" OUTBOX_DATABASE_IDENTITY_SQL;

constexpr char kInboxV5[] = R"sql(
-- Applied events an operator superseded when resolving a diverged
-- aggregate (EventSink.Rewind): their inbox rows move here, with who and
-- why, and their effects stay for the operator to compensate.
CREATE TABLE IF NOT EXISTS inbox_superseded (
  event_id      uuid NOT NULL,
  aggregate_id  text COLLATE "C" NOT NULL,
  seq           bigint NOT NULL,
  event_type    text NOT NULL,
  applied_at    timestamptz,
  superseded_at timestamptz NOT NULL DEFAULT now(),
  operator      text NOT NULL,
  reason        text NOT NULL,
  PRIMARY KEY (event_id, superseded_at)
);
)sql" OUTBOX_DATABASE_IDENTITY_SQL;

constexpr char kInboxV7[] = R"sql(
-- A chain is (source, aggregate_type, aggregate_id): the same id under
-- two types, or from two outbox databases, is two chains. Rows recorded
-- before keep '' for both (no table is rewritten: the columns have a
-- constant default); the first named source to send an event of such an
-- id takes its rows over (outbox_inbox_lock_chains), and only that source
-- (inbox_legacy_source) may take the others.
ALTER TABLE inbox
  ADD COLUMN IF NOT EXISTS source text COLLATE "C" NOT NULL DEFAULT '',
  ADD COLUMN IF NOT EXISTS aggregate_type text COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE aggregate_cursors
  ADD COLUMN IF NOT EXISTS source text COLLATE "C" NOT NULL DEFAULT '',
  ADD COLUMN IF NOT EXISTS aggregate_type text COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE held_events
  ADD COLUMN IF NOT EXISTS source text COLLATE "C" NOT NULL DEFAULT '',
  ADD COLUMN IF NOT EXISTS aggregate_type text COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE inbox_superseded
  ADD COLUMN IF NOT EXISTS source text COLLATE "C" NOT NULL DEFAULT '',
  ADD COLUMN IF NOT EXISTS aggregate_type text COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE held_actions
  ADD COLUMN IF NOT EXISTS source text COLLATE "C" NOT NULL DEFAULT '',
  ADD COLUMN IF NOT EXISTS aggregate_type text COLLATE "C" NOT NULL DEFAULT '';

-- The keys lead with the id: it tells two entries apart in the first
-- column compared, where a leading source would be compared whole first
-- (the same in most entries). Rows without a source are few (none once
-- taken over): a partial index finds whether there are any.
ALTER TABLE aggregate_cursors DROP CONSTRAINT IF EXISTS aggregate_cursors_pkey;
ALTER TABLE aggregate_cursors
  ADD PRIMARY KEY (aggregate_id, aggregate_type, source);
CREATE INDEX IF NOT EXISTS aggregate_cursors_unnamed_idx
  ON aggregate_cursors (aggregate_id) WHERE source = '';
CREATE UNIQUE INDEX IF NOT EXISTS inbox_chain_position_idx
  ON inbox (aggregate_id, aggregate_type, source, seq);
ALTER TABLE inbox DROP CONSTRAINT IF EXISTS inbox_aggregate_id_seq_key;
DROP INDEX IF EXISTS held_events_link_idx, held_events_position_idx;
CREATE UNIQUE INDEX IF NOT EXISTS held_events_chain_link_idx
  ON held_events (aggregate_id, aggregate_type, source, prev_seq);
CREATE UNIQUE INDEX IF NOT EXISTS held_events_chain_position_idx
  ON held_events (aggregate_id, aggregate_type, source, seq);

-- Which named source takes over the rows without one (source ''): those
-- recorded before chains had a source, and those of relays not upgraded
-- yet, which send none. NULL until a named source first meets one of
-- their ids; only that source takes the others.
CREATE TABLE IF NOT EXISTS inbox_legacy_source (
  id     int PRIMARY KEY DEFAULT 1 CHECK (id = 1),
  source text,
  since  timestamptz
);
INSERT INTO inbox_legacy_source (id) VALUES (1) ON CONFLICT DO NOTHING;

-- Locks the chains of a batch (transaction-scoped advisory locks of class
-- lock_class keyed by the aggregate id: chains of one id serialize, as
-- they did when the id alone named a chain, and in byte order of the id,
-- so that replicas never deadlock), then reads their cursors, with a
-- snapshot taken after the locks are held (the function is VOLATILE).
-- A chain (s, t, a) without a cursor takes over a cursor of id a without
-- a source, of type t or of none, with its inbox and held rows: a chain
-- without a source takes only the type, a named source also the rows,
-- if it is inbox_legacy_source's (the first to ask).
CREATE OR REPLACE FUNCTION outbox_inbox_lock_chains(sources text[],
                                                    types text[],
                                                    ids text[],
                                                    lock_class int)
RETURNS TABLE (source text, aggregate_type text, aggregate_id text,
               last_seq bigint, held_count int, pruned_through bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
  legacy text;
  r record;
BEGIN
  PERFORM pg_advisory_xact_lock(lock_class, hashtext(a))
     FROM (SELECT DISTINCT a FROM unnest(ids) AS a) d ORDER BY a COLLATE "C";
  -- One probe of a partial index: nothing to take over in the common case.
  IF EXISTS (SELECT 1 FROM aggregate_cursors x WHERE x.source = '') THEN
    FOR r IN
      SELECT k.s, k.t, k.a FROM unnest(sources, types, ids) AS k(s, t, a)
       WHERE NOT EXISTS (SELECT 1 FROM aggregate_cursors x
                          WHERE x.source = k.s AND x.aggregate_type = k.t
                            AND x.aggregate_id = k.a)
         AND EXISTS (SELECT 1 FROM aggregate_cursors x
                      WHERE x.source = '' AND x.aggregate_type IN ('', k.t)
                        AND x.aggregate_id = k.a)
    LOOP
      IF r.s <> '' THEN
        -- The first named source becomes the owner; the row lock makes
        -- two first ones wait for each other, and the second sees the
        -- first's name (a new snapshot per statement).
        UPDATE inbox_legacy_source l SET source = r.s, since = now()
         WHERE l.source IS NULL;
        SELECT l.source INTO legacy FROM inbox_legacy_source l;
        CONTINUE WHEN legacy IS DISTINCT FROM r.s;
      END IF;
      UPDATE aggregate_cursors x SET source = r.s, aggregate_type = r.t
       WHERE x.source = '' AND x.aggregate_type IN ('', r.t)
         AND x.aggregate_id = r.a;
      UPDATE inbox x SET source = r.s, aggregate_type = r.t
       WHERE x.source = '' AND x.aggregate_type IN ('', r.t)
         AND x.aggregate_id = r.a;
      UPDATE held_events x SET source = r.s, aggregate_type = r.t
       WHERE x.source = '' AND x.aggregate_type IN ('', r.t)
         AND x.aggregate_id = r.a;
    END LOOP;
  END IF;
  RETURN QUERY
    SELECT c.source::text, c.aggregate_type::text, c.aggregate_id::text,
           c.last_seq, c.held_count, c.pruned_through
      FROM unnest(sources, types, ids) AS k(s, t, a)
      JOIN LATERAL (SELECT * FROM aggregate_cursors x
                     WHERE x.source = k.s AND x.aggregate_type = k.t
                       AND x.aggregate_id = k.a LIMIT 1) c ON true;
END $$;
ALTER FUNCTION outbox_inbox_lock_chains(text[], text[], text[], int)
  SET plan_cache_mode = force_generic_plan;
DROP FUNCTION IF EXISTS outbox_inbox_lock_cursors(text[], int);
)sql";

// The common batch in one call (inbox/engine.cc): lock and read its
// chains' cursors as outbox_inbox_lock_chains does; then, where each chain
// stands where the batch expects (its cursor at from_seqs, 0 for none, and
// nothing held), insert the batch's inbox rows and move each cursor to
// through_seqs. Returns a row for each chain, with its cursor as it was
// (0s for none, as outbox_inbox_lock_chains returns no row for it) and
// the apply_ids the inbox rows took: 0, 0 when nothing was written. An id or
// position the inbox already holds takes the rows just inserted back out, and
// nothing is written: the caller plans the batch from the cursors as usual, and
// meets the collision there.
constexpr char kInboxV8[] = R"sql(
CREATE OR REPLACE FUNCTION outbox_inbox_apply_chains(
    sources text[], types text[], ids text[], lock_class int,
    from_seqs bigint[], through_seqs bigint[], event_ids uuid[],
    event_sources text[], event_types text[], event_aggregates text[],
    seqs bigint[], kinds text[], occurred timestamptz[])
RETURNS TABLE (source text, aggregate_type text, aggregate_id text,
               last_seq bigint, held_count int, pruned_through bigint,
               applied_from bigint, applied_through bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
  cs text[]; ct text[]; ca text[]; cl bigint[]; ch int[]; cp bigint[];
  written uuid[];
  first_id bigint := 0;
  last_id bigint := 0;
BEGIN
  SELECT array_agg(l.source), array_agg(l.aggregate_type),
         array_agg(l.aggregate_id), array_agg(l.last_seq),
         array_agg(l.held_count), array_agg(l.pruned_through)
    INTO cs, ct, ca, cl, ch, cp
    FROM outbox_inbox_lock_chains(sources, types, ids, lock_class) l;
  IF NOT EXISTS (
      SELECT 1 FROM unnest(sources, types, ids, from_seqs) AS k(s, t, a, e)
        LEFT JOIN unnest(cs, ct, ca, cl, ch) AS c(s, t, a, l, h)
          ON c.s = k.s AND c.t = k.t AND c.a = k.a
       WHERE coalesce(c.l, 0) <> k.e OR coalesce(c.h, 0) <> 0) THEN
    WITH i AS (
      INSERT INTO inbox (event_id, source, aggregate_type, aggregate_id, seq,
                         event_type, occurred_at)
      SELECT * FROM unnest(event_ids, event_sources, event_types,
                           event_aggregates, seqs, kinds, occurred)
      ON CONFLICT DO NOTHING RETURNING event_id, apply_id)
    SELECT array_agg(i.event_id), coalesce(min(i.apply_id), 0),
           coalesce(max(i.apply_id), 0)
      INTO written, first_id, last_id FROM i;
    IF coalesce(cardinality(written), 0) <> cardinality(event_ids) THEN
      DELETE FROM inbox x WHERE x.event_id = ANY(written);
      first_id := 0;
      last_id := 0;
    ELSE
      INSERT INTO aggregate_cursors (source, aggregate_type, aggregate_id,
                                     last_seq, held_count)
      SELECT * FROM unnest(sources, types, ids, through_seqs,
                           array_fill(0, ARRAY[cardinality(ids)]))
      ON CONFLICT (source, aggregate_type, aggregate_id) DO UPDATE SET
        last_seq = EXCLUDED.last_seq, held_count = 0, updated_at = now();
    END IF;
  END IF;
  -- Every chain asked about, 0s where it has no cursor yet.
  RETURN QUERY
    SELECT k.s, k.t, k.a, coalesce(c.l, 0), coalesce(c.h, 0),
           coalesce(c.p, 0), first_id, last_id
      FROM unnest(sources, types, ids) AS k(s, t, a)
      LEFT JOIN unnest(cs, ct, ca, cl, ch, cp) AS c(s, t, a, l, h, p)
        ON c.s = k.s AND c.t = k.t AND c.a = k.a;
END $$;
ALTER FUNCTION outbox_inbox_apply_chains(text[], text[], text[], int,
    bigint[], bigint[], uuid[], text[], text[], text[], bigint[], text[],
    timestamptz[])
  SET plan_cache_mode = force_generic_plan;
)sql";

// The outbox read as a log (relay/outbox_log.h). Each event records the
// top-level transaction that wrote it; a tick is a snapshot of which
// transactions had committed, with the highest seq visible in it, so that
// the events committed between two ticks can be read whatever their seq.
// Events from before this migration keep xid NULL: the ALTER waited for
// every transaction that wrote one, so all of them precede the first tick,
// made here, and no range holds them.
constexpr char kOutboxV6[] = R"sql(
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS xid xid8;
ALTER TABLE outbox ALTER COLUMN xid SET DEFAULT pg_current_xact_id();
-- (xid, seq): the late rows of a range (a transaction that drew its seq
-- before a tick and committed after it) are found by xid with their seq
-- checked in the index, without a visit to the table per new row.
CREATE INDEX IF NOT EXISTS outbox_xid_idx ON outbox (xid, seq);

CREATE TABLE IF NOT EXISTS outbox_ticks (
  id       bigint PRIMARY KEY,
  snapshot pg_snapshot NOT NULL,
  high_seq bigint NOT NULL,
  made_at  timestamptz NOT NULL DEFAULT now()
);

-- Makes the next tick. The advisory lock orders ticks: each one's
-- snapshot is taken after the one before committed, so it sees at least
-- what that one saw. Call it in READ COMMITTED (a statement's snapshot).
-- Refused while the database's transaction ids lie behind the last tick's
-- (a dump restored into another cluster): new events would seem to have
-- committed before old ticks, and ranges would pass over them.
CREATE OR REPLACE FUNCTION outbox_tick() RETURNS outbox_ticks
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  t outbox_ticks;
  last outbox_ticks;
BEGIN
  PERFORM pg_advisory_xact_lock(2833, 0);
  SELECT * INTO last FROM outbox_ticks ORDER BY id DESC LIMIT 1;
  IF last.id IS NOT NULL AND pg_snapshot_xmax(pg_current_snapshot()) <
                             pg_snapshot_xmax(last.snapshot) THEN
    RAISE EXCEPTION 'the outbox log cannot tick: this database''s transaction ids (next %) are behind those of its last tick % (next %)',
      pg_snapshot_xmax(pg_current_snapshot()), last.id,
      pg_snapshot_xmax(last.snapshot)
      USING ERRCODE = '55000',
            HINT = 'the database was restored from a dump into another cluster; its log positions must be rebased before delivery goes on';
  END IF;
  INSERT INTO outbox_ticks (id, snapshot, high_seq)
    SELECT coalesce((SELECT max(id) FROM outbox_ticks), 0) + 1,
           pg_current_snapshot(),
           coalesce((SELECT max(seq) FROM outbox), 0)
  RETURNING * INTO t;
  RETURN t;
END $$;
SELECT outbox_tick() WHERE NOT EXISTS (SELECT 1 FROM outbox_ticks);

-- Where each subscription's delivery from the log begins: the events its
-- start tick shows are not the log's to deliver (from before the log, they
-- are owed by outbox_delivery rows; or they precede the subscription).
-- NULL: the log does not deliver to it (the relay still delivers every
-- subscription from outbox_delivery).
ALTER TABLE subscriptions ADD COLUMN IF NOT EXISTS start_tick bigint;

-- A subscription's place on the log, per partition: every range up to
-- done_tick is delivered, and of the range (done_tick, reading_tick] the
-- events with seq <= after_seq (reading_tick 0: none begun). Moved only by
-- the partition's lease holder, forward only (relay/outbox_log.h).
CREATE TABLE IF NOT EXISTS outbox_log_positions (
  subscription text COLLATE "C" NOT NULL,
  partition    int NOT NULL,
  done_tick    bigint NOT NULL,
  reading_tick bigint NOT NULL DEFAULT 0,
  after_seq    bigint NOT NULL DEFAULT 0,
  moved_at     timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (subscription, partition),
  CHECK (reading_tick = 0 OR reading_tick > done_tick)
) WITH (fillfactor = 50);

-- Whether the log delivered event (seq, xid, partition) to `sub`: its
-- transaction shows in the snapshot of the partition's done tick, or in
-- the begun range's and the read passed its seq. Says nothing of events
-- the subscription's start tick shows (outbox_delivery has those) nor of
-- exceptions, which the caller looks up first.
CREATE OR REPLACE FUNCTION outbox_log_delivered(sub text, seq bigint,
                                                xid xid8, part int)
RETURNS boolean LANGUAGE sql STABLE AS $$
  SELECT coalesce((
    SELECT pg_visible_in_snapshot(xid, d.snapshot)
        OR (p.reading_tick > 0 AND seq <= p.after_seq
            AND pg_visible_in_snapshot(xid, r.snapshot))
      FROM outbox_log_positions p
      JOIN outbox_ticks d ON d.id = p.done_tick
      LEFT JOIN outbox_ticks r ON r.id = p.reading_tick
     WHERE p.subscription = sub AND p.partition = part), false)
$$;
)sql";

// The log delivers to the subscriptions that have a start tick: the trigger
// owes them nothing, retention keeps what their positions have not passed,
// and a subscription moves onto the log in one transaction.
constexpr char kOutboxV7[] = R"sql(
-- Every event inserted is owed, in the same transaction, to every
-- subscription the log does not deliver to; those it does deliver to get
-- an outbox_delivery row only as an exception (written by the relay).
CREATE OR REPLACE FUNCTION outbox_fan_out() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO outbox_delivery (subscription, seq, aggregate_id, partition)
    SELECT s.name, n.seq, n.aggregate_id, n.partition
      FROM new_events n CROSS JOIN subscriptions s
     WHERE n.seq >= s.start_seq AND s.start_tick IS NULL;
  RETURN NULL;
END $$;

-- The newest tick if it is younger than `min_age`, else a new one
-- (outbox_tick()): relays share ticks, so the rate of ticks stays near one
-- per min_age however many relays read. Call it in READ COMMITTED.
CREATE OR REPLACE FUNCTION outbox_tick_since(min_age interval)
RETURNS outbox_ticks LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  t outbox_ticks;
BEGIN
  SELECT * INTO t FROM outbox_ticks ORDER BY id DESC LIMIT 1;
  IF t.id IS NOT NULL AND t.made_at > clock_timestamp() - min_age THEN
    RETURN t;
  END IF;
  RETURN outbox_tick();
END $$;

-- The oldest tick the log's subscriptions still need: the lowest done
-- tick of their positions, and the start tick of one with a partition of
-- the `partitions` not read yet. NULL when the log delivers to none.
-- Every event its snapshot shows is delivered from the log (or owed by an
-- outbox_delivery row) to every subscription.
CREATE OR REPLACE FUNCTION outbox_log_floor(partitions int)
RETURNS bigint LANGUAGE sql STABLE AS $$
  SELECT least(
    (SELECT min(p.done_tick) FROM outbox_log_positions p
       JOIN subscriptions s ON s.name = p.subscription
      WHERE s.start_tick IS NOT NULL),
    (SELECT min(s.start_tick) FROM subscriptions s
      WHERE s.start_tick IS NOT NULL
        AND (SELECT count(*) FROM outbox_log_positions p
              WHERE p.subscription = s.name) < partitions))
$$;

-- Whether the log still owes event (seq, xid, partition) to `sub`: the
-- subscription is on the log, the event came after its start tick (a
-- pruned start tick lies below every position) and the log has not
-- delivered it. Exceptions (outbox_delivery rows) are the caller's to add.
CREATE OR REPLACE FUNCTION outbox_log_owed(sub text, seq bigint, xid xid8,
                                           part int)
RETURNS boolean LANGUAGE sql STABLE AS $$
  SELECT coalesce((
    SELECT s.start_tick IS NOT NULL AND xid IS NOT NULL AND seq >= s.start_seq
           AND NOT coalesce((SELECT pg_visible_in_snapshot(xid, t.snapshot)
                               FROM outbox_ticks t WHERE t.id = s.start_tick),
                            false)
           AND NOT outbox_log_delivered(sub, seq, xid, part)
      FROM subscriptions s WHERE s.name = sub), false)
$$;

-- Moves subscription `sub` onto the log: from a new tick on, the trigger
-- owes it nothing and the log delivers what that tick does not show. One
-- transaction with the tick: a writer whose trigger still owed the
-- subscription a row may also be in the log (delivered twice, answered
-- DUPLICATE); one whose trigger did not committed after the tick, so the
-- log has it. Its outbox_delivery rows stay and are delivered as before.
-- Returns the start tick; does nothing to a subscription on the log.
CREATE OR REPLACE FUNCTION outbox_log_subscribe(sub text)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  tick bigint;
BEGIN
  SELECT start_tick INTO tick FROM subscriptions WHERE name = sub FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no subscription "%"', sub USING ERRCODE = '42704';
  END IF;
  IF tick IS NOT NULL THEN
    RETURN tick;
  END IF;
  tick := (outbox_tick()).id;
  UPDATE subscriptions SET start_tick = tick WHERE name = sub;
  RETURN tick;
END $$;
)sql";

#undef OUTBOX_DATABASE_IDENTITY_SQL

}  // namespace

// outbox_tick() as in version 6, refused outside READ COMMITTED: there a
// transaction's snapshot is taken at its first statement, maybe before the
// lock that orders ticks was granted, so a tick could show less than the
// one before it and ranges would pass over events (a database or role
// whose default_transaction_isolation is REPEATABLE READ, say). The
// relays' sessions set it to READ COMMITTED (common/db.cc); this catches
// any other caller, and a pooled session that kept the server's default.
constexpr char kOutboxV11[] = R"sql(
CREATE OR REPLACE FUNCTION outbox_tick() RETURNS outbox_ticks
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  t outbox_ticks;
  last outbox_ticks;
BEGIN
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    RAISE EXCEPTION 'the outbox log cannot tick in a % transaction',
      current_setting('transaction_isolation')
      USING ERRCODE = '25000',
            HINT = 'ticks are made in READ COMMITTED; set default_transaction_isolation to read committed for the relay''s role or database';
  END IF;
  PERFORM pg_advisory_xact_lock(2833, 0);
  SELECT * INTO last FROM outbox_ticks ORDER BY id DESC LIMIT 1;
  IF last.id IS NOT NULL AND pg_snapshot_xmax(pg_current_snapshot()) <
                             pg_snapshot_xmax(last.snapshot) THEN
    RAISE EXCEPTION 'the outbox log cannot tick: this database''s transaction ids (next %) are behind those of its last tick % (next %)',
      pg_snapshot_xmax(pg_current_snapshot()), last.id,
      pg_snapshot_xmax(last.snapshot)
      USING ERRCODE = '55000',
            HINT = 'the database was restored from a dump into another cluster; its log positions must be rebased before delivery goes on';
  END IF;
  INSERT INTO outbox_ticks (id, snapshot, high_seq)
    SELECT coalesce((SELECT max(id) FROM outbox_ticks), 0) + 1,
           pg_current_snapshot(),
           coalesce((SELECT max(seq) FROM outbox), 0)
  RETURNING * INTO t;
  RETURN t;
END $$;
)sql";

// Marks of how far retention may go (relay/retention.cc): the sequence's
// last value, and the transactions of this database open when it was
// read. Once none of them is open, every event with a seq up to it has
// committed or never will, so deleting up to it leaves no committed event
// below an event deleted.
constexpr char kOutboxV12[] = R"sql(
CREATE TABLE IF NOT EXISTS outbox_retention_marks (
  last_seq   bigint NOT NULL,
  open_xacts text[] NOT NULL,
  taken_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
)sql";

// How far retention deleted (relay/retention.cc): the newest seq it
// deleted, kept beside the outbox so that it replicates, dumps and
// restores with it. Below it every event went to retention; an event
// missing above it went some other way (lost with a failover or a
// restore). Reading that from the rows left (their lowest seq, or the
// next seq to draw when none is left) took a failover's lost events for
// retention's once the new primary had handed out their seqs again and
// retention had deleted what lay below. Where retention ran before this
// table, that reading is where it starts.
constexpr char kOutboxV13[] = R"sql(
CREATE TABLE IF NOT EXISTS outbox_retention_state (
  id              int PRIMARY KEY CHECK (id = 1),
  deleted_through bigint NOT NULL
);
INSERT INTO outbox_retention_state (id, deleted_through)
SELECT 1, coalesce((SELECT min(seq) FROM outbox), (SELECT CASE WHEN is_called
       THEN last_value + 1 ELSE last_value END FROM outbox_seq_seq)) - 1
ON CONFLICT (id) DO NOTHING;
)sql";

// Any binary that reaches the outbox's database after a failover or a
// restore records its new identity: the producer at its start, a relay as
// it takes up its subscription or deletes old events. Whichever does,
// every subscription's heal is requested in the same statement. Before,
// only the relays that noticed the change requested the heal of their own
// subscription: one whose relays were down then, when another binary had
// recorded the new identity first, was never healed, and retention could
// delete what its heal needed before a relay came.
constexpr char kOutboxV14[] = R"sql(
CREATE OR REPLACE FUNCTION outbox_identity_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  UPDATE subscriptions SET heal_requested_at = now(),
    heal_reason = 'the outbox database changed under it (failover or '
      || 'restore): its identity was ' || OLD.identity || ', is '
      || NEW.identity;
  RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS outbox_identity_changed ON outbox_database_identity;
CREATE TRIGGER outbox_identity_changed AFTER UPDATE OF identity
  ON outbox_database_identity FOR EACH ROW
  WHEN (OLD.identity IS DISTINCT FROM NEW.identity)
  EXECUTE FUNCTION outbox_identity_changed();
)sql";

// Rotation (relay/retention.h): an operator may make the outbox a table
// partitioned by seq range (outbox_partition_outbox, made again by
// version 16, run by `outboxctl partition-outbox`); retention then empties
// and drops whole children instead of deleting rows. The migration only
// adds what that needs; a plain outbox stays as it is.
//
// outbox_rotation: the children's span (seqs), how many spans stay made
// ahead of the sequence, and the upper bound of the newest child made.
// PostgreSQL keeps a unique key on a partitioned table only with the
// partition column, so event_id is unique per child; ids the writer makes
// are time-ordered UUIDs (48 bits of milliseconds, 74 random), and an id a
// caller gives is checked by outbox_event_ids_free before the append.
constexpr char kOutboxV15[] = R"sql(
CREATE TABLE IF NOT EXISTS outbox_rotation (
  id         int PRIMARY KEY CHECK (id = 1),
  -- The newest child's span, and the least any child spans.
  span       bigint NOT NULL CHECK (span > 0),
  min_span   bigint NOT NULL CHECK (min_span > 0),
  ahead      int NOT NULL CHECK (ahead > 0),
  made_to    bigint NOT NULL,
  -- Children sized to what the writers draw in this long at the rate seen
  -- since the last was made (at least min_span, at most 100 times it);
  -- NULL: min_span each.
  span_time  interval CHECK (span_time > interval '0'),
  made_at    timestamptz NOT NULL DEFAULT now(),
  drawn_then bigint NOT NULL DEFAULT 0
);

-- Refuses an id a caller gives that an event the outbox retains carries:
-- the unique key does that on a plain outbox, and on a partitioned one
-- (unique per child only) this check, made before the append. It locks
-- each id (an advisory lock on its hash, held to the transaction's end),
-- then looks for it in a snapshot taken after the lock (each statement
-- of this VOLATILE function takes its own in READ COMMITTED): of two
-- writers of one id the second waits and sees the first's commit. A
-- snapshot older than the lock (REPEATABLE READ, SERIALIZABLE) could
-- miss it, so given ids are refused there.
CREATE OR REPLACE FUNCTION outbox_event_ids_free(ids uuid[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  taken uuid;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM outbox_rotation) THEN RETURN; END IF;
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    RAISE feature_not_supported USING MESSAGE = format(
      'event_id given by the caller needs a READ COMMITTED transaction on '
      'a partitioned outbox, not %s (or leave event_id empty for a new one)',
      current_setting('transaction_isolation'));
  END IF;
  PERFORM pg_advisory_xact_lock(2835, h)
     FROM (SELECT DISTINCT hashtext(id::text) AS h FROM unnest(ids) id
            ORDER BY 1) locks;
  SELECT o.event_id INTO taken FROM outbox o
   WHERE o.event_id = ANY(ids) LIMIT 1;
  IF FOUND THEN
    RAISE unique_violation USING MESSAGE = format(
      'event_id %s is taken: an event the outbox retains carries it', taken);
  END IF;
END $$;
)sql";

// The outbox's grants survive partitioning. The parent is a new table:
// without them a role other than the owner that wrote or read the outbox
// (a producer's own role, a reader's) was refused from then on, and one
// that could insert also needs USAGE on the new sequence (an identity
// column needed none). Version 15 made outbox_partition_outbox without
// this; a database partitioned under it gets the grants of outbox_s0 if
// that child is still there, and USAGE for those that may insert now.
//
// And the conversion need not scan the old table under its exclusive
// lock (ATTACH checks that every row lies within the partition's bound:
// seconds for tens of millions of rows, every writer waiting): a bound
// prepared and validated before (outbox_partition_prepare, `outboxctl
// partition-outbox`'s first steps) already says so.
constexpr char kOutboxV16[] = R"sql(
-- A grantee as GRANT names it (aclexplode's 0: PUBLIC).
CREATE OR REPLACE FUNCTION outbox_grantee(role oid) RETURNS text
LANGUAGE sql STABLE AS $$
  SELECT CASE WHEN role = 0 THEN 'PUBLIC'
              ELSE quote_ident(pg_get_userbyid(role)) END
$$;

-- Grants table `src`'s privileges again on the outbox, each to its
-- grantee (PUBLIC too) with its grant option, those on columns too, and
-- USAGE on outbox_seq_seq to every grantee that may insert into the
-- outbox then. `src` NULL: the sequence's only. Returns how many grants
-- it gave.
CREATE OR REPLACE FUNCTION outbox_partition_grants(src regclass)
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
  g record;
  n int := 0;
BEGIN
  -- The table's grants (col NULL) and its columns', one per row.
  FOR g IN
    SELECT a.privilege_type, a.is_grantable, a.grantee, NULL::text AS col
      FROM pg_class c, aclexplode(c.relacl) a
     WHERE c.oid = src
    UNION ALL
    SELECT a.privilege_type, a.is_grantable, a.grantee, t.attname::text
      FROM pg_attribute t, aclexplode(t.attacl) a
     WHERE t.attrelid = src AND t.attacl IS NOT NULL AND NOT t.attisdropped
  LOOP
    CONTINUE WHEN g.grantee = (SELECT relowner FROM pg_class
                                WHERE oid = 'outbox'::regclass);
    EXECUTE format('GRANT %s%s ON TABLE outbox TO %s%s', g.privilege_type,
                   CASE WHEN g.col IS NULL THEN ''
                        ELSE format(' (%I)', g.col) END,
                   outbox_grantee(g.grantee),
                   CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION'
                        ELSE '' END);
    n := n + 1;
  END LOOP;
  IF to_regclass('outbox_seq_seq') IS NOT NULL THEN
    FOR g IN
      SELECT DISTINCT a.grantee
        FROM pg_class c, aclexplode(c.relacl) a
       WHERE c.oid = 'outbox'::regclass AND a.privilege_type = 'INSERT'
         AND a.grantee <> c.relowner
    LOOP
      EXECUTE format('GRANT USAGE ON SEQUENCE outbox_seq_seq TO %s',
                     outbox_grantee(g.grantee));
      n := n + 1;
    END LOOP;
  END IF;
  RETURN n;
END $$;

-- A bound prepared for the old table (outbox_partition_prepare): every
-- seq of the plain outbox lies below `bound` (the CHECK constraint
-- outbox_s0_bound says so, validated by a scan that holds up no writer),
-- so that ATTACH, under the exclusive lock, need not scan it again (nor
-- build its event_id index, made before as well). Once the writers draw
-- past `expires` without the outbox partitioned, the bound goes
-- (outbox_partition_bound_expire), long before an insert could meet it.
CREATE TABLE IF NOT EXISTS outbox_partition_bound (
  id      int PRIMARY KEY CHECK (id = 1),
  bound   bigint NOT NULL,
  expires bigint NOT NULL,
  made_at timestamptz NOT NULL DEFAULT now()
);

-- Puts a bound `margin` seqs beyond the next one on the plain outbox, as
-- the constraint outbox_s0_bound NOT VALID (a moment's exclusive lock, no
-- scan), unless one is there with at least a quarter of `margin` left;
-- returns it (NULL: partitioned already, or empty: nothing to check).
-- The caller then runs ALTER TABLE outbox VALIDATE CONSTRAINT
-- outbox_s0_bound (SHARE UPDATE EXCLUSIVE: writers and readers go on),
-- builds the index the parent's event_id index will want of the old table
-- (CREATE INDEX CONCURRENTLY outbox_s0_event_id_idx ON outbox (event_id):
-- ATTACH would build it under the lock) and calls
-- outbox_partition_outbox. An unused bound takes that index with it.
CREATE OR REPLACE FUNCTION outbox_partition_prepare(margin bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
  next_seq bigint;
  b outbox_partition_bound;
BEGIN
  IF margin IS NULL OR margin < 1000 THEN
    RAISE invalid_parameter_value USING
      MESSAGE = format('margin must be at least 1000 seqs, not %s', margin);
  END IF;
  IF EXISTS (SELECT 1 FROM outbox_rotation) OR
     NOT EXISTS (SELECT 1 FROM outbox) THEN
    RETURN NULL;
  END IF;
  LOCK TABLE outbox_partition_bound IN EXCLUSIVE MODE;
  SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END
    INTO next_seq FROM outbox_seq_seq;
  SELECT * INTO b FROM outbox_partition_bound WHERE id = 1;
  IF FOUND AND b.expires - next_seq >= margin / 4 AND EXISTS (
       SELECT 1 FROM pg_constraint c
        WHERE c.conrelid = 'outbox'::regclass
          AND c.conname = 'outbox_s0_bound') THEN
    RETURN b.bound;
  END IF;
  ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_s0_bound;
  EXECUTE format('ALTER TABLE outbox ADD CONSTRAINT outbox_s0_bound '
                 'CHECK (seq < %s) NOT VALID', next_seq + margin);
  INSERT INTO outbox_partition_bound (id, bound, expires)
    VALUES (1, next_seq + margin, next_seq + margin / 2)
    ON CONFLICT (id) DO UPDATE SET bound = EXCLUDED.bound,
                                   expires = EXCLUDED.expires,
                                   made_at = now();
  RETURN next_seq + margin;
END $$;

-- Drops a prepared bound the writers drew past its `expires` while the
-- outbox stayed plain (the operator's command was stopped between its
-- steps), or any with `force`, waiting 100 ms at most for the exclusive
-- lock (the next call tries again).
CREATE OR REPLACE FUNCTION outbox_partition_bound_expire(
    force boolean DEFAULT false)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
  b outbox_partition_bound;
  drawn bigint;
  waited text := current_setting('lock_timeout');
BEGIN
  SELECT * INTO b FROM outbox_partition_bound WHERE id = 1;
  IF NOT FOUND OR EXISTS (SELECT 1 FROM outbox_rotation) THEN RETURN; END IF;
  SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END
    INTO drawn FROM outbox_seq_seq;
  IF drawn < b.expires AND NOT force THEN RETURN; END IF;
  PERFORM set_config('lock_timeout', '100ms', true);
  BEGIN
    ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_s0_bound;
    DROP INDEX IF EXISTS outbox_s0_event_id_idx;
    DELETE FROM outbox_partition_bound WHERE id = 1;
  EXCEPTION WHEN lock_not_available THEN
    NULL;
  END;
  PERFORM set_config('lock_timeout', waited, true);
END $$;

-- Makes children until `ahead` spans lie beyond the sequence; returns how
-- many seqs can still be drawn before an insert finds no child (NULL on a
-- plain outbox, where it drops a bound prepared and not used in time:
-- outbox_partition_bound_expire). CREATE TABLE and ATTACH (SHARE UPDATE
-- EXCLUSIVE on the parent) hold up no writer and no reader, as CREATE ...
-- PARTITION OF (ACCESS EXCLUSIVE) would.
CREATE OR REPLACE FUNCTION outbox_extend_partitions() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
  r outbox_rotation;
  drawn bigint;
  hi bigint;
  elapsed float8;
  child text;
BEGIN
  SELECT * INTO r FROM outbox_rotation WHERE id = 1;
  IF NOT FOUND THEN
    PERFORM outbox_partition_bound_expire();
    RETURN NULL;
  END IF;
  SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END
    INTO drawn FROM outbox_seq_seq;
  IF r.made_to - 1 - drawn >= r.ahead::bigint * r.span THEN
    RETURN r.made_to - 1 - drawn;
  END IF;
  SELECT * INTO r FROM outbox_rotation WHERE id = 1 FOR UPDATE;
  elapsed := extract(epoch FROM now() - r.made_at);
  IF r.span_time IS NOT NULL AND elapsed >= 1 THEN
    r.span := least(r.min_span * 100, greatest(r.min_span,
      ceil((drawn - r.drawn_then) / elapsed
           * extract(epoch FROM r.span_time))::bigint));
  END IF;
  WHILE r.made_to - 1 - drawn < r.ahead::bigint * r.span LOOP
    child := 'outbox_s' || r.made_to;
    -- After the children ran out, the seqs the failed inserts drew are
    -- gone: the next child takes them in, rather than a child of them
    -- each, empty.
    hi := greatest(r.made_to, drawn + 1) + r.span;
    EXECUTE format('CREATE TABLE %I (LIKE outbox INCLUDING DEFAULTS '
                   'INCLUDING CONSTRAINTS)', child);
    EXECUTE format('ALTER TABLE outbox ATTACH PARTITION %I FOR VALUES FROM '
                   '(%s) TO (%s)', child, r.made_to, hi);
    r.made_to := hi;
  END LOOP;
  UPDATE outbox_rotation SET made_to = r.made_to, span = r.span,
         made_at = now(), drawn_then = drawn WHERE id = 1;
  RETURN r.made_to - 1 - drawn;
END $$;

-- Makes the plain outbox the first child of a parent partitioned by seq
-- range, in one transaction that holds the outbox exclusively (a moment:
-- nothing is copied). seq then draws from a plain sequence of the same
-- name (PostgreSQL 15 has no identity column on a partitioned table);
-- the views that read the outbox and the delivery trigger are made again
-- on the parent, and the old table's grants are given on it (with USAGE
-- on the sequence to those that may insert). The old table keeps its own
-- indexes, event_id's unique
-- one among them (an empty one is dropped); each new child has the
-- parent's: seq (the key), (xid, seq) and event_id. With a validated bound
-- prepared (outbox_partition_prepare) the old table holds the seqs below
-- it, new ones too until the writers reach it, and ATTACH does not scan
-- it under the lock; without one, ATTACH scans it to check that every seq
-- lies below the next.
CREATE OR REPLACE FUNCTION outbox_partition_outbox(span bigint, ahead int,
                                                   span_time interval
                                                     DEFAULT NULL)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
  next bigint;
  upper_bound bigint;
  empty boolean;
  v record;
  views text[] := '{}';
  defs text[] := '{}';
BEGIN
  IF span IS NULL OR span < 1 THEN
    RAISE invalid_parameter_value USING
      MESSAGE = format('span must be at least 1 seq, not %s', span);
  END IF;
  IF ahead IS NULL OR ahead < 1 THEN
    RAISE invalid_parameter_value USING
      MESSAGE = format('ahead must be at least 1 span, not %s', ahead);
  END IF;
  IF span_time <= interval '0' THEN
    RAISE invalid_parameter_value USING
      MESSAGE = format('span_time must be positive, not %s', span_time);
  END IF;
  IF EXISTS (SELECT 1 FROM outbox_rotation) THEN
    RETURN 'the outbox is partitioned already';
  END IF;
  LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE;
  -- Another call may have partitioned it while this one waited.
  LOCK TABLE outbox_rotation IN SHARE MODE;
  IF EXISTS (SELECT 1 FROM outbox_rotation) THEN
    RETURN 'the outbox is partitioned already';
  END IF;
  FOR v IN SELECT DISTINCT c.oid::regclass::text AS name,
                  pg_get_viewdef(c.oid) AS def
             FROM pg_depend d JOIN pg_rewrite w ON w.oid = d.objid
             JOIN pg_class c ON c.oid = w.ev_class
            WHERE d.refobjid = 'outbox'::regclass AND c.relkind = 'v' LOOP
    views := views || v.name;
    defs := defs || v.def;
  END LOOP;
  SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END
    INTO next FROM outbox_seq_seq;
  next := greatest(next, coalesce((SELECT max(seq) FROM outbox), 0) + 1);
  empty := NOT EXISTS (SELECT 1 FROM outbox);
  SELECT b.bound INTO upper_bound FROM outbox_partition_bound b
   WHERE b.bound > next AND EXISTS (
           SELECT 1 FROM pg_constraint c
            WHERE c.conrelid = 'outbox'::regclass
              AND c.conname = 'outbox_s0_bound' AND c.convalidated);
  IF upper_bound IS NULL OR empty THEN upper_bound := next; END IF;
  ALTER TABLE outbox RENAME TO outbox_s0;
  DROP TRIGGER IF EXISTS outbox_fan_out ON outbox_s0;
  ALTER TABLE outbox_s0 ALTER COLUMN seq DROP IDENTITY;
  EXECUTE format('CREATE SEQUENCE outbox_seq_seq START %s', next);
  CREATE TABLE outbox (LIKE outbox_s0 INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (seq);
  -- LIKE copied the prepared bound: the parent must not have it.
  ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_s0_bound;
  ALTER TABLE outbox ALTER COLUMN seq SET DEFAULT nextval('outbox_seq_seq');
  ALTER SEQUENCE outbox_seq_seq OWNED BY outbox.seq;
  ALTER TABLE outbox ADD PRIMARY KEY (seq);
  CREATE INDEX outbox_parent_xid_idx ON outbox (xid, seq);
  CREATE INDEX outbox_parent_event_id_idx ON outbox (event_id);
  PERFORM outbox_partition_grants('outbox_s0');
  IF NOT empty THEN
    EXECUTE format('ALTER TABLE outbox ATTACH PARTITION outbox_s0 FOR VALUES '
                   'FROM (MINVALUE) TO (%s)', upper_bound);
  END IF;
  -- The partition's bound says it now.
  ALTER TABLE outbox_s0 DROP CONSTRAINT IF EXISTS outbox_s0_bound;
  DELETE FROM outbox_partition_bound;
  CREATE TRIGGER outbox_fan_out AFTER INSERT ON outbox
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_fan_out();
  FOR i IN 1 .. coalesce(array_length(views, 1), 0) LOOP
    EXECUTE format('CREATE OR REPLACE VIEW %s AS %s', views[i], defs[i]);
  END LOOP;
  -- An empty outbox needs no child below the next seq: one kept would
  -- cost every read a lock until retention dropped it.
  IF empty THEN DROP TABLE outbox_s0; END IF;
  INSERT INTO outbox_rotation (id, span, min_span, ahead, made_to,
                               span_time, drawn_then)
    VALUES (1, span, span, ahead, upper_bound, span_time, next - 1);
  PERFORM outbox_extend_partitions();
  RETURN format('the outbox is partitioned: %s, then children of %s seqs%s, '
                '%s made ahead',
                CASE WHEN empty THEN 'empty'
                     WHEN upper_bound > next THEN format(
                       'seqs below %s in outbox_s0 (its bound checked '
                       'before, not under the lock)', upper_bound)
                     ELSE format('seqs below %s in outbox_s0', next) END,
                span, CASE WHEN span_time IS NULL THEN '' ELSE format(
                  ' or what the writers draw in %s, at most %s',
                  span_time, span * 100) END, ahead);
END $$;

DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM outbox_rotation) THEN
    PERFORM outbox_partition_grants(to_regclass('outbox_s0'));
  END IF;
EXCEPTION WHEN insufficient_privilege THEN
  RAISE WARNING 'the partitioned outbox''s grants were not given again (%); its owner can give them: SELECT outbox_partition_grants(to_regclass(''outbox_s0''))',
    SQLERRM;
END $$;
)sql";

const std::vector<Migration>& OutboxMigrations() {
  // The view derives each event's state as the admin API does.
  static const std::string kOutboxV1 = absl::StrCat(
      R"sql(
CREATE TABLE IF NOT EXISTS outbox (
  seq            bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
  event_id       uuid NOT NULL UNIQUE,
  aggregate_type text NOT NULL,
  aggregate_id   text NOT NULL,
  prev_seq       bigint NOT NULL CHECK (prev_seq >= 0),
  event_type     text NOT NULL,
  schema_version int NOT NULL,
  -- The serialized outbox.v1.Event (protobuf); `outboxctl show` decodes it.
  payload        bytea NOT NULL,
  trace_parent   text,
  partition      int NOT NULL,
  created_at     timestamptz NOT NULL DEFAULT now()
);

-- Each aggregate's newest event: the next one's prev_seq. The writer
-- locks and moves it in the statement that appends the event, so the
-- events of one aggregate form one chain whatever the business tables.
CREATE TABLE IF NOT EXISTS outbox_heads (
  aggregate_type text COLLATE "C" NOT NULL,
  aggregate_id   text COLLATE "C" NOT NULL,
  last_seq       bigint NOT NULL,
  -- The head before the last append (what that append returned).
  prev_seq       bigint NOT NULL DEFAULT 0,
  PRIMARY KEY (aggregate_type, aggregate_id)
) WITH (fillfactor = 70);
INSERT INTO outbox_heads (aggregate_type, aggregate_id, last_seq)
  SELECT aggregate_type, aggregate_id, max(seq) FROM outbox GROUP BY 1, 2
  ON CONFLICT DO NOTHING;

-- Who receives the events. Each subscription has its own delivery state,
-- attempts, dead letters and partition ownership. id keys its advisory
-- locks; start_seq: events below it were never meant for it; chain_from:
-- an event whose prev_seq is below it is the first of its chain for this
-- subscription (the predecessor was never owed to it: written before a
-- subscription that starts from now, or deleted by retention before one
-- that starts from the oldest retained event).
CREATE TABLE IF NOT EXISTS subscriptions (
  name       text PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9_-]{0,62}$'),
  id         int GENERATED ALWAYS AS IDENTITY UNIQUE,
  start_seq  bigint NOT NULL DEFAULT 0,
  created_at timestamptz NOT NULL DEFAULT now(),
  chain_from bigint NOT NULL DEFAULT 0
);
ALTER TABLE subscriptions ADD COLUMN IF NOT EXISTS chain_from bigint NOT NULL DEFAULT 0;

-- The events a subscription has not been given yet: a row per (subscription,
-- event) from the event's insert (trigger below) until the consumer
-- answered it, when the relay deletes it. pending: to deliver (after
-- available_at); dead: rejected --max_attempts times (requeue puts it back).
-- Only undelivered rows live here, so claims and marks cost O(backlog),
-- never O(history), and marking delivered writes no new row version.
-- Identifiers compare as bytes (COLLATE "C"): index lookups by them then
-- cost a memcmp instead of a locale-aware comparison.
CREATE TABLE IF NOT EXISTS outbox_delivery (
  subscription text COLLATE "C" NOT NULL,
  seq          bigint NOT NULL,
  aggregate_id text COLLATE "C" NOT NULL,
  partition    int NOT NULL,
  status       text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'dead')),
  attempts     int NOT NULL DEFAULT 0,
  available_at timestamptz NOT NULL DEFAULT now(),
  last_error   text,
  dead_at      timestamptz,
  PRIMARY KEY (subscription, seq)
);

-- A database of a release that kept one delivery state in the outbox row:
-- that state becomes the "billing" subscription's (the only consumer then).
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM information_schema.columns
              WHERE table_schema = current_schema() AND table_name = 'outbox'
                AND column_name = 'status') THEN
    INSERT INTO subscriptions (name) VALUES ('billing') ON CONFLICT DO NOTHING;
    ALTER TABLE outbox ADD COLUMN IF NOT EXISTS dead_at timestamptz;
    INSERT INTO outbox_delivery (subscription, seq, aggregate_id, partition,
                                 status, attempts, available_at, last_error,
                                 dead_at)
      SELECT 'billing', seq, aggregate_id, partition, status, attempts,
             available_at, last_error,
             CASE WHEN status = 'dead' THEN coalesce(dead_at, available_at) END
        FROM outbox WHERE status <> 'delivered'
      ON CONFLICT DO NOTHING;
    DROP INDEX IF EXISTS outbox_pending_idx, outbox_undelivered_idx,
                         outbox_published_idx, outbox_dead_idx;
    ALTER TABLE outbox DROP COLUMN status, DROP COLUMN attempts,
      DROP COLUMN available_at, DROP COLUMN last_error,
      DROP COLUMN published_at, DROP COLUMN dead_at;
  END IF;
END $$;

-- Every event inserted, however (the writer, a migration, a test), is
-- owed to every subscription, in the same transaction.
CREATE OR REPLACE FUNCTION outbox_fan_out() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO outbox_delivery (subscription, seq, aggregate_id, partition)
    SELECT s.name, n.seq, n.aggregate_id, n.partition
      FROM new_events n CROSS JOIN subscriptions s
     WHERE n.seq >= s.start_seq;
  RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER outbox_fan_out AFTER INSERT ON outbox
  REFERENCING NEW TABLE AS new_events
  FOR EACH STATEMENT EXECUTE FUNCTION outbox_fan_out();

-- For operators: every retained event's state for every subscription.
)sql",
      kDeliveriesViewHead, kDeliveryStatusV1Sql, kDeliveriesViewFrom, ";\n");
  static const std::string kOutboxV7WithView =
      absl::StrCat(kOutboxV7, kDeliveriesViewHead, kDeliveryStatusV7Sql,
                   kDeliveriesViewFrom, ";\n");
  static const std::string kOutboxV9 = absl::StrCat(
      "-- The view's status reads positions and ticks by join, not by a\n"
      "-- function call per event.\n",
      kDeliveriesViewHead, kDeliveryStatusSql, kDeliveriesViewFrom,
      kDeliveryLogJoinsSql, ";\n");
  // An operator moves a subscription onto the log and off it again
  // (RelayAdmin.MoveSubscriptionToLog, MoveSubscriptionToRows). Off it,
  // what the log still owes must become rows without a gap: the lock waits
  // for every writer of the outbox (producers among them) and holds new
  // ones until the subscription is off the log. Each statement of a
  // VOLATILE function in READ COMMITTED reads a new snapshot: the INSERT
  // sees what committed while the LOCK waited, and so does the trigger of
  // a READ COMMITTED writer that waited. A writer in REPEATABLE READ or
  // SERIALIZABLE reads the snapshot its transaction began with, which may
  // show the subscription still on the log after it is off: its trigger
  // owes rows to every subscription, exceptions that the log's reads join
  // instead of sending (relay/log_reader.h).
  static const std::string kOutboxV10 = absl::StrCat(R"sql(
CREATE OR REPLACE FUNCTION outbox_fan_out() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  fresh boolean := current_setting('transaction_isolation') = 'read committed';
BEGIN
  INSERT INTO outbox_delivery (subscription, seq, aggregate_id, partition)
    SELECT s.name, n.seq, n.aggregate_id, n.partition
      FROM new_events n CROSS JOIN subscriptions s
     WHERE n.seq >= s.start_seq AND (s.start_tick IS NULL OR NOT fresh);
  RETURN NULL;
END $$;

ALTER TABLE subscription_actions
  DROP CONSTRAINT IF EXISTS subscription_actions_action_check;
ALTER TABLE subscription_actions
  ADD CONSTRAINT subscription_actions_action_check
  CHECK (action IN ('pause', 'resume', 'drop', 'resubscribe', 'to_log',
                    'to_rows'));

-- Moves `sub` off the outbox log: every event the log still owes it
-- becomes a pending delivery row, its positions go, and from then on the
-- producer's trigger owes it rows. Returns how many it owes as rows now.
CREATE OR REPLACE FUNCTION outbox_log_unsubscribe(sub text)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  owed bigint;
BEGIN
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    RAISE EXCEPTION 'outbox_log_unsubscribe needs READ COMMITTED: it must '
      'see what committed while it waited for the outbox''s writers'
      USING ERRCODE = '25000';
  END IF;
  LOCK TABLE outbox IN SHARE MODE;
  PERFORM 1 FROM subscriptions WHERE name = sub FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no subscription "%"', sub USING ERRCODE = '42704';
  END IF;
  WITH ins AS (
    INSERT INTO outbox_delivery (subscription, seq, aggregate_id, partition)
    SELECT s.name, o.seq, o.aggregate_id, o.partition
      FROM outbox o JOIN subscriptions s ON s.name = sub
      LEFT JOIN outbox_delivery d ON d.subscription = s.name AND d.seq = o.seq
)sql",
                                                     kDeliveryLogJoinsSql,
                                                     R"sql(
     WHERE s.start_tick IS NOT NULL AND d.seq IS NULL
       -- Only what a position's (or the start tick's) snapshot may not
       -- show: the xid index, not the whole outbox.
       AND o.xid >= coalesce((SELECT min(pg_snapshot_xmin(t.snapshot))
                                FROM outbox_ticks t
                               WHERE t.id = s.start_tick
                                  OR t.id IN (SELECT done_tick
                                                FROM outbox_log_positions
                                               WHERE subscription = sub)),
                             '0'::xid8)
       AND )sql",
                                                     kDeliveryStatusSql,
                                                     R"sql( = 'pending'
    ON CONFLICT DO NOTHING RETURNING 1)
  SELECT count(*) INTO owed FROM ins;
  DELETE FROM outbox_log_positions WHERE subscription = sub;
  UPDATE subscriptions SET start_tick = NULL WHERE name = sub;
  RETURN owed;
END $$;
)sql");
  static const std::vector<Migration> kMigrations = {
      {1, "events, chain heads, subscriptions and their deliveries",
       kOutboxV1.c_str()},
      {2, "dead letters by index", R"sql(
-- Dead letters are few; a partial index lists them (and their age) without
-- reading the pending rows, and costs nothing for those.
CREATE INDEX IF NOT EXISTS outbox_delivery_dead_idx
  ON outbox_delivery (subscription, dead_at) WHERE status = 'dead';
)sql"},
      {3, "partition leases, diverged histories, database identity", kOutboxV3},
      {4, "subscriptions paused, dropped, and who did it", R"sql(
-- An operator's pause: the subscription's relays claim nothing until it
-- is resumed (events keep being owed to it).
ALTER TABLE subscriptions
  ADD COLUMN IF NOT EXISTS paused_at timestamptz,
  ADD COLUMN IF NOT EXISTS paused_by text,
  ADD COLUMN IF NOT EXISTS paused_reason text;
-- Who paused, resumed or dropped which subscription, and why; a relay
-- refuses to make a dropped subscription again unless told to
-- (--resubscribe, recorded here too).
CREATE TABLE IF NOT EXISTS subscription_actions (
  id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  at           timestamptz NOT NULL DEFAULT now(),
  subscription text NOT NULL,
  action       text NOT NULL
               CHECK (action IN ('pause', 'resume', 'drop', 'resubscribe')),
  actor        text NOT NULL,
  reason       text NOT NULL,
  detail       text NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS subscription_actions_by_name
  ON subscription_actions (subscription, id);
)sql"},
      {5, "the outbox's source name, divergences by chain", R"sql(
-- The name events of this outbox carry (Event.source): with the aggregate
-- type and id it names a chain at a consumer that takes events from
-- several outboxes. Recorded once, by the first relay (its --source, or
-- the database's name and a random suffix, so that two shards of one name
-- on two servers still differ), and kept through failovers, dumps and
-- restores with the events.
CREATE TABLE IF NOT EXISTS outbox_source (
  id          int PRIMARY KEY DEFAULT 1 CHECK (id = 1),
  name        text NOT NULL CHECK (name ~ '^[A-Za-z0-9._-]{1,64}$'),
  recorded_at timestamptz NOT NULL DEFAULT now(),
  recorded_by text NOT NULL
);
-- A divergence is of a chain: (aggregate_type, aggregate_id). Rows from
-- before keep '' (any type of the id).
ALTER TABLE outbox_divergences
  ADD COLUMN IF NOT EXISTS aggregate_type text COLLATE "C" NOT NULL DEFAULT '';
DROP INDEX IF EXISTS outbox_divergences_open_idx;
CREATE UNIQUE INDEX IF NOT EXISTS outbox_divergences_open_chain_idx
  ON outbox_divergences (subscription, aggregate_type, aggregate_id)
  WHERE resolved_at IS NULL;
)sql"},
      {6, "the outbox as a log: each event's transaction, ticks", kOutboxV6},
      {7, "the log delivers to subscriptions with a start tick",
       kOutboxV7WithView.c_str()},
      {8, "a subscription moved onto the log starts with no old positions",
       R"sql(
-- Positions left by a subscription of the same name that was deleted
-- would point before the new start tick (or at ticks pruned since): they
-- go when a subscription begins on the log.
CREATE OR REPLACE FUNCTION outbox_log_subscribe(sub text)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  tick bigint;
BEGIN
  SELECT start_tick INTO tick FROM subscriptions WHERE name = sub FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no subscription "%"', sub USING ERRCODE = '42704';
  END IF;
  IF tick IS NOT NULL THEN
    RETURN tick;
  END IF;
  DELETE FROM outbox_log_positions WHERE subscription = sub;
  tick := (outbox_tick()).id;
  UPDATE subscriptions SET start_tick = tick WHERE name = sub;
  RETURN tick;
END $$;
DELETE FROM outbox_log_positions p
 WHERE NOT EXISTS (SELECT 1 FROM subscriptions s
                    WHERE s.name = p.subscription AND s.start_tick IS NOT NULL);

-- What the log owes `sub` in each of `parts` that it owes anything (as
-- outbox_log_owed says of each event, in one scan of the xid index from
-- the oldest snapshot needed instead of a function call per event, which
-- took 12 s for 100,000 events): how many (at most `cap` counted), since
-- when, and the lowest seq. A partition without a position is read from
-- the start tick.
CREATE OR REPLACE FUNCTION outbox_log_owed_by(sub text, parts int[],
                                              cap bigint)
RETURNS TABLE (part int, events bigint, oldest timestamptz, lowest bigint)
LANGUAGE sql STABLE AS $$
  WITH pos AS (
    SELECT w.p AS part, coalesce(d.snapshot, st.snapshot) AS done_snap,
           r.snapshot AS reading_snap, coalesce(lp.after_seq, 0) AS after_seq
      FROM unnest(parts) AS w(p)
      JOIN subscriptions s ON s.name = sub AND s.start_tick IS NOT NULL
      LEFT JOIN outbox_ticks st ON st.id = s.start_tick
      LEFT JOIN outbox_log_positions lp
             ON lp.subscription = sub AND lp.partition = w.p
      LEFT JOIN outbox_ticks d ON d.id = lp.done_tick
      LEFT JOIN outbox_ticks r ON r.id = lp.reading_tick
                              AND lp.reading_tick > 0
  ), owed AS (
    SELECT o.partition, o.seq, o.created_at
      FROM outbox o JOIN pos ON pos.part = o.partition
     WHERE o.xid >= (SELECT min(pg_snapshot_xmin(done_snap)) FROM pos)
       AND o.seq >= (SELECT start_seq FROM subscriptions WHERE name = sub)
       AND pos.done_snap IS NOT NULL
       AND NOT pg_visible_in_snapshot(o.xid, pos.done_snap)
       AND NOT (pos.reading_snap IS NOT NULL AND o.seq <= pos.after_seq
                AND pg_visible_in_snapshot(o.xid, pos.reading_snap))
     LIMIT cap
  )
  SELECT partition, count(*), min(created_at), min(seq) FROM owed
   GROUP BY partition
$$;
)sql"},
      {9, "delivery states joined to the log's positions", kOutboxV9.c_str()},
      {10, "operators move subscriptions onto the log and off it",
       kOutboxV10.c_str()},
      {11, "a tick is refused outside READ COMMITTED", kOutboxV11},
      {12, "retention waits for transactions that may still commit below",
       kOutboxV12},
      {13, "retention records how far it deleted", kOutboxV13},
      {14, "a changed identity requests every subscription's heal", kOutboxV14},
      {15, "the outbox may be partitioned for rotation", kOutboxV15},
      {16, "partitioning keeps the outbox's grants, and need not scan it",
       kOutboxV16},
  };
  return kMigrations;
}

const std::vector<Migration>& InboxMigrations() {
  static const std::vector<Migration> kMigrations = {
      {1, "inbox, aggregate cursors and held events", R"sql(
-- One row per applied event, in apply order (apply_id). Identifiers
-- compare as bytes (COLLATE "C"): a memcmp instead of a locale-aware
-- comparison on every lookup.
CREATE TABLE IF NOT EXISTS inbox (
  event_id     uuid PRIMARY KEY,
  aggregate_id text COLLATE "C" NOT NULL,
  seq          bigint NOT NULL,
  event_type   text NOT NULL,
  apply_id     bigint GENERATED ALWAYS AS IDENTITY,
  occurred_at  timestamptz,
  applied_at   timestamptz NOT NULL DEFAULT now(),
  UNIQUE (aggregate_id, seq)
);

-- Each aggregate's applied position, and how many of its events are held.
-- Room on each page (fillfactor), so that updates stay on their page and
-- write no index entry.
CREATE TABLE IF NOT EXISTS aggregate_cursors (
  aggregate_id text COLLATE "C" PRIMARY KEY,
  last_seq     bigint NOT NULL DEFAULT 0,
  updated_at   timestamptz NOT NULL DEFAULT now(),
  held_count   int NOT NULL DEFAULT 0
) WITH (fillfactor = 70);

-- Events that arrived before their predecessor: one per link and position.
CREATE TABLE IF NOT EXISTS held_events (
  event_id     uuid PRIMARY KEY,
  aggregate_id text COLLATE "C" NOT NULL,
  seq          bigint NOT NULL,
  prev_seq     bigint NOT NULL,
  payload      bytea NOT NULL,
  received_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS held_events_age_idx ON held_events (received_at);

-- A database of a release whose billing migrations made these tables
-- (before the engine owned them) may lack the later changes.
DO $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                  WHERE table_schema = current_schema()
                    AND table_name = 'aggregate_cursors'
                    AND column_name = 'held_count') THEN
    ALTER TABLE aggregate_cursors ADD COLUMN held_count int NOT NULL DEFAULT 0;
    DELETE FROM held_events h USING aggregate_cursors c
     WHERE h.aggregate_id = c.aggregate_id AND h.seq <= c.last_seq;
    DELETE FROM held_events a USING held_events b
     WHERE a.aggregate_id = b.aggregate_id
       AND (a.prev_seq = b.prev_seq OR a.seq = b.seq)
       AND (a.received_at, a.event_id) > (b.received_at, b.event_id);
    DROP INDEX IF EXISTS held_events_next_idx;
    INSERT INTO aggregate_cursors (aggregate_id)
      SELECT DISTINCT aggregate_id FROM held_events ON CONFLICT DO NOTHING;
    UPDATE aggregate_cursors c SET held_count = h.n
      FROM (SELECT aggregate_id, count(*) AS n FROM held_events GROUP BY 1) h
     WHERE c.aggregate_id = h.aggregate_id;
  END IF;
  IF EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'inbox_apply_id_key') THEN
    ALTER TABLE inbox DROP CONSTRAINT inbox_apply_id_key;
    ALTER TABLE inbox ALTER COLUMN aggregate_id TYPE text COLLATE "C";
    ALTER TABLE aggregate_cursors ALTER COLUMN aggregate_id TYPE text COLLATE "C";
    ALTER TABLE held_events ALTER COLUMN aggregate_id TYPE text COLLATE "C";
    ALTER TABLE aggregate_cursors SET (fillfactor = 70);
  END IF;
END $$;
CREATE UNIQUE INDEX IF NOT EXISTS held_events_link_idx
  ON held_events (aggregate_id, prev_seq);
CREATE UNIQUE INDEX IF NOT EXISTS held_events_position_idx
  ON held_events (aggregate_id, seq);
)sql"},
      {2, "inbox retention", R"sql(
-- How far inbox retention deleted each aggregate's inbox rows: a passed
-- position at or below it is a redelivery, answered DUPLICATE.
ALTER TABLE aggregate_cursors
  ADD COLUMN IF NOT EXISTS pruned_through bigint NOT NULL DEFAULT 0;
-- Finds the old rows without a full scan; a block-range index costs
-- applying next to nothing, unlike a btree.
CREATE INDEX IF NOT EXISTS inbox_applied_at_brin ON inbox USING brin (applied_at);
)sql"},
      {3, "lock and read cursors in one call", R"sql(
-- Locks the aggregates of a batch (transaction-scoped advisory locks of
-- class lock_class, in the order given), then reads their cursors. One
-- round trip for both: being VOLATILE, the function runs the read with a
-- snapshot taken after the locks are held, so it sees what the locks'
-- last holders committed (a statement that waited for a lock would not).
-- LIMIT 1 keeps each lookup an index probe in any cached plan.
CREATE OR REPLACE FUNCTION outbox_inbox_lock_cursors(aggregates text[],
                                                     lock_class int)
RETURNS TABLE (aggregate_id text, last_seq bigint, held_count int,
               pruned_through bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
  PERFORM pg_advisory_xact_lock(lock_class, hashtext(a))
     FROM unnest(aggregates) AS a;
  RETURN QUERY
    SELECT c.aggregate_id::text, c.last_seq, c.held_count, c.pruned_through
      FROM unnest(aggregates) AS a
      JOIN LATERAL (SELECT * FROM aggregate_cursors x
                     WHERE x.aggregate_id = a LIMIT 1) c ON true;
END $$;
)sql"},
      {4, "cursor read planned once per session", R"sql(
-- Left to itself, PostgreSQL plans the cursor read again on every call:
-- its generic plan's estimate (10 aggregates for the unnest) exceeds that
-- of a plan for the few a batch passes. That plan is an index probe per
-- aggregate whatever the table's size (see above), so it is always taken.
ALTER FUNCTION outbox_inbox_lock_cursors(text[], int)
  SET plan_cache_mode = force_generic_plan;
)sql"},
      {5, "superseded events, database identity", kInboxV5},
      {6, "held events' failures and operators' actions", R"sql(
-- A held event whose own effect fails as it drains is charged here (its
-- predecessor applies; the chain waits at it) until an operator releases
-- it for another try or skips it.
ALTER TABLE held_events
  ADD COLUMN IF NOT EXISTS attempts int NOT NULL DEFAULT 0,
  ADD COLUMN IF NOT EXISTS last_error text,
  ADD COLUMN IF NOT EXISTS failed_at timestamptz;
-- Who released or skipped which held event, and why.
CREATE TABLE IF NOT EXISTS held_actions (
  id           bigserial PRIMARY KEY,
  at           timestamptz NOT NULL DEFAULT now(),
  event_id     uuid NOT NULL,
  aggregate_id text COLLATE "C" NOT NULL,
  seq          bigint NOT NULL,
  action       text NOT NULL CHECK (action IN ('release', 'skip')),
  actor        text NOT NULL,
  reason       text NOT NULL,
  outcome      text NOT NULL
);
)sql"},
      {7, "chains named by source, aggregate type and id", kInboxV7},
      {8, "the common batch written as its cursors are read", kInboxV8},
  };
  return kMigrations;
}

namespace {

HealDue HealFromRow(const pqxx::row& heal) {
  return HealDue{heal["requested_at"].as<std::string>(),
                 heal["reason"].as<std::string>(),
                 absl::Seconds(heal["age_s"].as<double>())};
}

}  // namespace

std::string HealDue::Text() const {
  return absl::StrFormat("%s, requested %.1f s ago", reason,
                         absl::ToDoubleSeconds(age));
}

std::optional<HealDue> DueHeal(pqxx::transaction_base& outbox,
                               const std::string& subscription) {
  const pqxx::result heal = outbox.exec_params(kHealDueSql, subscription);
  if (heal.empty()) return std::nullopt;
  return HealFromRow(heal[0]);
}

std::string DueHealText(pqxx::transaction_base& outbox,
                        const std::string& subscription) {
  const std::optional<HealDue> due = DueHeal(outbox, subscription);
  return due ? due->Text() : "";
}

std::map<std::string, HealDue> DueHeals(pqxx::transaction_base& outbox) {
  std::map<std::string, HealDue> out;
  for (const pqxx::row& heal : outbox.exec_params(kHealDueSql, "")) {
    out.emplace(heal["name"].as<std::string>(), HealFromRow(heal));
  }
  return out;
}

}  // namespace outbox
