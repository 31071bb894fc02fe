#include "producer/order_schema.h"

namespace outbox::producer {

// Versions 1-3 once also made the outbox tables; the outbox schema
// (applied first) now owns them and adopts a database that has them.
const std::vector<Migration>& OrdersMigrations() {
  static const std::vector<Migration> kMigrations = {
      {1, "orders and outbox", R"sql(
CREATE TABLE orders (
  order_id        uuid PRIMARY KEY,
  customer_id     text NOT NULL,
  items           jsonb NOT NULL,
  currency        text NOT NULL,
  total_cents     bigint NOT NULL CHECK (total_cents >= 0),
  status          text NOT NULL CHECK (status IN ('CREATED', 'PAID', 'CANCELLED')),
  version         bigint NOT NULL CHECK (version >= 1),
  idempotency_key text UNIQUE,
  -- Fingerprint of the request that first used idempotency_key.
  request_hash    text,
  created_at      timestamptz NOT NULL DEFAULT now(),
  updated_at      timestamptz NOT NULL DEFAULT now()
);
)sql"},
      {2, "when a row became a dead letter",
       "SELECT 1  -- now the outbox schema's"},
      {3, "delivery state per subscription, apart from the immutable event",
       "SELECT 1  -- now the outbox schema's"},
      {4, "the chain head of each order moves to outbox_heads", R"sql(
-- Orders used to keep their newest event's seq (the next prev_seq) in
-- orders.last_event_seq; the outbox writer keeps it in outbox_heads.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM information_schema.columns
              WHERE table_schema = current_schema() AND table_name = 'orders'
                AND column_name = 'last_event_seq') THEN
    INSERT INTO outbox_heads (aggregate_type, aggregate_id, last_seq)
      SELECT 'order', order_id::text, last_event_seq FROM orders
       WHERE last_event_seq > 0
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE
      SET last_seq = greatest(outbox_heads.last_seq, EXCLUDED.last_seq);
    ALTER TABLE orders DROP COLUMN last_event_seq;
  END IF;
END $$;
)sql"},
  };
  return kMigrations;
}

}  // namespace outbox::producer
