#include "inbox/jetstream_source.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/fault.h"
#include "spdlog/spdlog.h"

namespace outbox::inbox {
namespace {

// The delay before the n-th redelivery of an event the engine refused.
absl::Duration RefusedDelay(const JetStreamSourceOptions& o,
                            uint64_t delivered) {
  absl::Duration d = o.reject_backoff;
  for (uint64_t i = 1; i < delivered && d < o.reject_backoff_max; ++i) d *= 2;
  return std::min(d, o.reject_backoff_max);
}

}  // namespace

namespace {

constexpr char kAcks[] = "outbox_consumer_jetstream_acks_total";
constexpr char kAcksHelp[] =
    "JetStream messages acknowledged after their inbox transaction "
    "committed (applied, duplicate or held).";
constexpr char kRedeliveries[] = "outbox_consumer_jetstream_redeliveries_total";
constexpr char kRedeliveriesHelp[] =
    "JetStream messages left for redelivery: refused by the engine "
    "(REJECTED, DIVERGED, DEFERRED) or not taken by the database.";
constexpr char kUnreadable[] = "outbox_consumer_jetstream_unreadable_total";
constexpr char kUnreadableHelp[] =
    "JetStream messages that were not an outbox Event, acknowledged and "
    "dropped.";
constexpr char kParked[] = "outbox_consumer_jetstream_parked_total";
constexpr char kParkedHelp[] =
    "JetStream events refused on --jetstream_park_after deliveries, parked "
    "as failed held events for an operator and acknowledged.";
constexpr char kFailures[] = "outbox_consumer_jetstream_failures_total";
constexpr char kFailuresHelp[] =
    "Failed JetStream calls (connect, bind, fetch, ack).";

}  // namespace

void JetStreamSource::RegisterMetrics(Metrics* metrics) {
  metrics->AddCounter(kAcks, kAcksHelp);
  metrics->AddCounter(kRedeliveries, kRedeliveriesHelp);
  metrics->AddCounter(kUnreadable, kUnreadableHelp);
  metrics->AddCounter(kParked, kParkedHelp);
  metrics->AddCounter(kFailures, kFailuresHelp);
}

JetStreamSource::JetStreamSource(JetStreamSourceOptions options, Engine* engine,
                                 Metrics* metrics)
    : options_(std::move(options)),
      engine_(engine),
      applied_(metrics->AddCounter(kAcks, kAcksHelp)),
      redelivered_(metrics->AddCounter(kRedeliveries, kRedeliveriesHelp)),
      unreadable_(metrics->AddCounter(kUnreadable, kUnreadableHelp)),
      parked_(metrics->AddCounter(kParked, kParkedHelp)),
      failures_(metrics->AddCounter(kFailures, kFailuresHelp)) {}

JetStreamSource::~JetStreamSource() { Stop(); }

void JetStreamSource::Start() {
  if (worker_.joinable()) return;
  worker_ = std::thread([this] { Run(); });
}

void JetStreamSource::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (worker_.joinable()) worker_.join();
}

bool JetStreamSource::Sleep(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  return !mu_.AwaitWithTimeout(absl::Condition(&stopping_), d);
}

void JetStreamSource::Run() {
  absl::Duration backoff = absl::Milliseconds(250);
  std::string last_error;
  auto failed = [&](const absl::Status& s) {
    failures_->Add();
    if (last_error != s.message()) {
      spdlog::warn("consumer: JetStream {}: {}", options_.stream,
                   std::string(s.message()));
      last_error = std::string(s.message());
    }
    if (!Sleep(backoff)) return false;
    backoff = std::min(backoff * 2, absl::Seconds(5));
    return true;
  };
  for (;;) {
    absl::StatusOr<std::unique_ptr<jetstream::Connection>> conn =
        jetstream::Connection::Connect(options_.connect);
    if (!conn.ok()) {
      if (!failed(conn.status())) return;
      continue;
    }
    absl::StatusOr<std::unique_ptr<jetstream::PullConsumer>> consumer;
    for (;;) {
      consumer =
          (*conn)->PullSubscribe({.stream = options_.stream,
                                  .durable = options_.durable,
                                  .filter_subject = options_.filter_subject,
                                  .ack_wait = options_.ack_wait,
                                  .max_ack_pending = options_.max_ack_pending});
      if (consumer.ok() || (*conn)->closed()) break;
      if (!failed(consumer.status())) return;
    }
    if (!consumer.ok()) continue;  // the connection was given up
    spdlog::info("consumer: reading JetStream stream {} as {}", options_.stream,
                 options_.durable);
    last_error.clear();
    backoff = absl::Milliseconds(250);
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
      }
      if ((*conn)->closed()) {
        // Given up by the client (or closed): connect anew.
        spdlog::warn("consumer: JetStream connection closed; connecting anew");
        break;
      }
      if (Step(**consumer)) {
        backoff = absl::Milliseconds(250);
      } else if (!Sleep(backoff)) {
        return;
      } else {
        backoff = std::min(backoff * 2, absl::Seconds(5));
      }
    }
  }
}

bool JetStreamSource::Step(jetstream::PullConsumer& consumer) {
  absl::StatusOr<std::vector<jetstream::Message>> fetched =
      consumer.Fetch(options_.batch, absl::Seconds(1));
  if (!fetched.ok()) {
    failures_->Add();
    spdlog::warn("consumer: JetStream fetch: {}",
                 std::string(fetched.status().message()));
    return false;
  }
  if (fetched->empty()) return true;
  std::vector<v1::Event> events;
  std::vector<jetstream::Message*> of_event;
  events.reserve(fetched->size());
  for (jetstream::Message& m : *fetched) {
    v1::Event e;
    if (!e.ParseFromString(m.data()) || e.event_id().empty()) {
      spdlog::error(
          "consumer: JetStream message {} on {} is not an outbox Event; "
          "acknowledged and dropped",
          m.stream_seq(), m.subject());
      unreadable_->Add();
      if (m.Ack().ok()) ++acked_;
      continue;
    }
    events.push_back(std::move(e));
    of_event.push_back(&m);
  }
  if (events.empty()) return true;
  std::vector<const v1::Event*> batch;
  for (const v1::Event& e : events) batch.push_back(&e);
  absl::StatusOr<std::vector<v1::EventResult>> results =
      engine_->ApplyBatch(batch);
  if (!results.ok()) {
    // Not the events' fault: they come again, uncounted.
    spdlog::warn("consumer: JetStream batch of {} not applied: {}",
                 events.size(), std::string(results.status().message()));
    for (jetstream::Message* m : of_event) (void)m->Nak(absl::Seconds(1));
    redelivered_->Add(static_cast<int64_t>(of_event.size()));
    return false;
  }
  // Committed, not acknowledged: redelivered, and DUPLICATE then.
  MaybeCrash("consumer.after_commit_before_answer");
  // The acks go out together and one flush waits for the server to have
  // them all; one that is lost anyway brings its message back after
  // ack_wait, answered DUPLICATE then.
  absl::Status ack_status;
  int64_t acks = 0;
  for (size_t i = 0; i < of_event.size() && i < results->size(); ++i) {
    jetstream::Message& m = *of_event[i];
    const v1::EventResult& r = (*results)[i];
    switch (r.outcome()) {
      case v1::APPLIED:
      case v1::DUPLICATE:
      case v1::HELD:
        if (absl::Status s = m.AckNoWait(); s.ok()) {
          ++acks;
        } else if (ack_status.ok()) {
          ack_status = s;
        }
        break;
      case v1::DEFERRED:
        (void)m.Nak(absl::Seconds(1));
        redelivered_->Add();
        break;
      case v1::REJECTED:
        if (static_cast<int64_t>(m.num_delivered()) >= options_.park_after) {
          // Refused on every delivery: parked in the inbox as a failed held
          // event, for an operator (there is no relay to keep the dead
          // letter), and acknowledged once it is.
          absl::Status parked =
              engine_->ParkRefused(events[i], r.reason(), m.num_delivered());
          if (parked.ok()) {
            if (absl::Status s = m.AckNoWait(); s.ok()) {
              ++acks;
              parked_->Add();
            } else if (ack_status.ok()) {
              ack_status = s;
            }
            break;
          }
          if (absl::IsInvalidArgument(parked)) {
            // Can be stored nowhere, nor ever applied.
            spdlog::error(
                "consumer: JetStream message {} holds an event that can "
                "never apply nor be parked ({}); acknowledged and dropped",
                m.stream_seq(), std::string(parked.message()));
            unreadable_->Add();
            if (m.AckNoWait().ok()) ++acks;
            break;
          }
          spdlog::warn("consumer: {}; it stays in the stream",
                       std::string(parked.message()));
        }
        [[fallthrough]];
      default: {
        const absl::Duration delay = RefusedDelay(options_, m.num_delivered());
        spdlog::warn(
            "consumer: event {} (seq {}) {} on delivery {}: {}; again in {}",
            r.event_id(), r.seq(), v1::DeliveryOutcome_Name(r.outcome()),
            m.num_delivered(), r.reason(), absl::FormatDuration(delay));
        (void)m.Nak(delay);
        redelivered_->Add();
      }
    }
  }
  if (ack_status.ok()) ack_status = consumer.Flush(absl::Seconds(5));
  if (!ack_status.ok()) {
    failures_->Add();
    spdlog::warn("consumer: JetStream acks of a batch of {}: {}",
                 of_event.size(), std::string(ack_status.message()));
    return false;
  }
  acked_ += acks;
  applied_->Add(acks);
  return true;
}

}  // namespace outbox::inbox
