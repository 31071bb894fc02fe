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

// The partition of `aggregate_id`: FNV-1a, stable across builds and hosts.
int PartitionOf(absl::string_view aggregate_id);

void ToTimestamp(absl::Time t, google::protobuf::Timestamp* out);
absl::Time FromTimestamp(const google::protobuf::Timestamp& ts);
// `ts` as a timestamptz literal in UTC, e.g. for an array parameter.
std::string SqlTimestamp(const google::protobuf::Timestamp& ts);

}  // namespace outbox
