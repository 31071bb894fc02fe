#pragma once
// What a relay is told: its databases, its subscription, its sink and the
// limits and intervals of its delivery (relay/main.cc maps its flags here).

#include <functional>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "common/db.h"
#include "common/tls.h"
#include "relay/fence.h"
#include "relay/sink.h"
#include "relay/subscribe.h"

namespace outbox::relay {

struct RelayOptions {
  std::string db_url;
  // The subscription this relay delivers (created on first use, see
  // StartFrom); replicas of one subscription share its partitions.
  std::string subscription = "billing";
  // The name events of this outbox carry (Event.source), recorded in the
  // outbox by the first relay; "" takes what is recorded, or records a
  // default (the database's name and a random suffix).
  std::string source;
  StartFrom start_from = StartFrom::kOldest;
  // Make the subscription anew (per start_from) even if an operator dropped
  // it; otherwise a dropped subscription is refused, loudly.
  bool resubscribe = false;
  // Move the subscription onto the outbox log (docs/log-delivery.md) if it
  // is not: from then on the producer's transactions write nothing for it
  // and delivering an event writes nothing per event. A subscription on
  // the log is delivered from it whatever this says; one an operator moved
  // off the log stays off (RelayAdmin.MoveSubscriptionToRows). False: a
  // new subscription is delivered by rows (one per event).
  bool log_delivery = true;
  DbSession session;     // limits of every database session
  std::string consumer;  // host:port of EventSink
  // Where batches go instead of `consumer` (a JetStreamSink), started and
  // stopped by the relay. Null: the consumer over gRPC.
  std::shared_ptr<Sink> sink;
  ClientTlsFiles consumer_tls;  // none: plaintext
  int max_attempts = 5;
  int batch_size = 512;  // events per DeliverRequest
  int window = 2048;     // events in flight at most
  // Batches in flight at most, per lane, while there is a backlog (each
  // batch in flight was full); otherwise one. Two keep the consumer busy
  // while an answer travels back; more would only split the backlog into
  // smaller batches (one commit each) instead of letting a batch fill up.
  int pipeline_depth = 2;
  // Delivery streams. While there is a backlog, each open stream carries
  // its own share of the partitions and the consumer applies their batches
  // in parallel; otherwise the first open stream carries them all, so that
  // the small batches of a moderate rate reach the consumer one at a time
  // and grow while it applies the one before (fewer, larger transactions).
  // Order does not depend on the stream: an aggregate's next event is
  // claimed only once the one before it is marked.
  int lanes = 2;
  absl::Duration poll_interval = absl::Milliseconds(500);
  absl::Duration ack_timeout = absl::Seconds(15);
  absl::Duration rebalance_interval = absl::Seconds(1);
  // How often the backlog figures are read (they also are whenever the
  // owned partitions change).
  absl::Duration backlog_refresh = absl::Seconds(15);
  absl::Duration retry_initial = absl::Milliseconds(100);  // transport backoff
  absl::Duration retry_max = absl::Seconds(5);
  absl::Duration reject_backoff = absl::Milliseconds(500);  // first REJECTED
  absl::Duration reject_backoff_max = absl::Seconds(60);
  // Delivered rows older than this are deleted in small batches by the
  // replica that owns partition 0, so the outbox does not grow forever.
  // Zero keeps every row.
  absl::Duration retention;
  // How long retention rests once it has caught up before it looks again.
  absl::Duration retention_interval = absl::Minutes(1);
  // How long a partition lease lasts without renewal (renewed every
  // rebalance_interval): a replica that dies or freezes keeps its
  // partitions this long at most.
  absl::Duration lease_ttl = absl::Seconds(5);
  // A relay whose consumer has not answered for this long (neither a batch
  // nor a health check of outbox.v1.EventSink, tried every second) turns
  // readiness NOT_SERVING and gives its partitions (and its membership) to
  // the replicas that reach the consumer, until it answers again. Zero
  // disables.
  absl::Duration consumer_unready_after = absl::Seconds(15);
  // Where the listener LISTENs; empty: db_url. Behind a transaction pooler
  // LISTEN cannot work: give a direct URL, or the relay polls every
  // fast_poll_interval instead.
  std::string notify_url;
  absl::Duration fast_poll_interval = absl::Milliseconds(25);
  // Deliver only what enough standbys flushed (relay/fence.h).
  FenceOptions fence;
  // For tests: runs on the worker right after each claim statement, with
  // the number of rows it returned.
  std::function<void(size_t rows)> after_claim;
  // For tests: runs on the listener thread each time it begins (true) or
  // stops (false) listening for NOTIFYs.
  std::function<void(bool listening)> on_listening;
};

}  // namespace outbox::relay
