#pragma once
// Identifiers shared by the producer, relay and consumer: UUIDs, W3C trace
// context, and the partition an aggregate belongs to.

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "google/protobuf/timestamp.pb.h"

namespace outbox {

// Number of outbox partitions. Stored in each outbox row, so it may only
// change together with a migration that rewrites them.
inline constexpr int kPartitionCount = 32;

// A random (version 4) UUID in canonical lower-case form.
std::string NewUuid();

// A time-ordered (version 7, RFC 9562) UUID in canonical lower-case form:
// the Unix time in milliseconds, then 74 random bits. Rows keyed by them
// are added at the right end of a btree index rather than at random
// places, so an index much larger than memory costs no reads to insert
// into. For new rows' keys (orders, events); not where a prefix must be
// random: the first 12 hex digits are the clock.
std::string NewTimeOrderedUuid();

// True for the canonical 8-4-4-4-12 hex form (any case).
bool IsUuid(absl::string_view s);

// True for a W3C traceparent of version 00:
// "00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>", lower-case hex
// only, ids not all zero. Any other version (ff is never valid) is refused.
// TraceIdOf (common/log.h) reads the trace id of exactly these.
bool IsTraceParent(absl::string_view s);

// A new sampled traceparent with random ids.
std::string NewTraceParent();

// A chain of events (one aggregate's history, linked by prev_seq) is
// named by the outbox it comes from (its source: the relay's --source,
// "" for events that carry none), the aggregate's type and its id. The
// same id under two types, or in two outbox databases, is two chains.
struct ChainId {
  std::string source, type, id;
};
// `c` as one string, for a map key: lengths prefix the source and the
// type, so different chains never share a key. ParseChainKey reverses it.
std::string ChainKey(absl::string_view source, absl::string_view type,
                     absl::string_view id);
inline std::string ChainKey(const ChainId& c) {
  return ChainKey(c.source, c.type, c.id);
}
bool ParseChainKey(absl::string_view key, ChainId* out);
// The parts of a ChainKey as views into it, without copying.
struct ChainView {
  absl::string_view source, type, id;
};
bool ParseChainKey(absl::string_view key, ChainView* out);
// The aggregate id of a ChainKey, without copying; `key` itself if it is
// not one.
absl::string_view ChainIdOf(absl::string_view key);
// The chain of an event-like message (aggregate_type(), aggregate_id()
// and, where it has one, source()).
template <typename E>
std::string ChainKeyOf(const E& e) {
  return ChainKey(e.source(), e.aggregate_type(), e.aggregate_id());
}
// A source's name: 1-64 bytes of ASCII letters, digits, '.', '_', '-'.
bool IsSourceName(absl::string_view name);
// For people: "order X", "order X of source S", "X" (a chain recorded
// before chains had a type: source and type empty).
std::string ChainLabel(absl::string_view key);

// The partition of `aggregate_id`: FNV-1a, stable across builds and hosts.
int PartitionOf(absl::string_view aggregate_id);

void ToTimestamp(absl::Time t, google::protobuf::Timestamp* out);
absl::Time FromTimestamp(const google::protobuf::Timestamp& ts);
// `ts` as a timestamptz literal in UTC, e.g. for an array parameter.
std::string SqlTimestamp(const google::protobuf::Timestamp& ts);

}  // namespace outbox
