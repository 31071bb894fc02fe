#pragma once
// NATS subjects for outbox events: one subject per aggregate, under a
// prefix of the operator's choosing, so that a JetStream stream orders
// each aggregate's events and a per-subject expected sequence chains them.
//
//   auto subject = jetstream::EventSubject("outbox.billing", "order", "o-1");
//   // "outbox.billing.order.o-1"
//   auto odd = jetstream::EventSubject("outbox", "order", "a.b *>");
//   // "outbox.order.a~2Eb~20~2A~3E"
//
// A subject is dot-separated tokens; a token must not be empty nor hold
// `.`, `*`, `>` or whitespace. Aggregate types and ids are arbitrary bytes,
// so each goes through EscapeToken, which is injective: distinct
// (type, id) pairs never share a subject.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace outbox::jetstream {

// One subject token for any byte string: `A-Z a-z 0-9 - _` stay as they
// are, every other byte becomes `~` and two upper-case hex digits, and the
// empty string becomes a lone `~` (no escape is a lone `~`, so that is
// unambiguous). The result is never empty and only holds `A-Z a-z 0-9 - _ ~`.
std::string EscapeToken(absl::string_view raw);

// The inverse of EscapeToken; InvalidArgument for a token EscapeToken does
// not produce (a bad or lower-case escape, a character outside its set).
absl::StatusOr<std::string> UnescapeToken(absl::string_view token);

// Whether `prefix` is one or more dot-separated tokens of `A-Z a-z 0-9 - _`
// (no wildcard, no `$` system prefix, no empty token).
bool IsValidPrefix(absl::string_view prefix);

// Whether `name` can name a JetStream stream or durable consumer: not
// empty, and no `.`, `*`, `>` or ASCII whitespace (space, \t, \n, \v, \f,
// \r). Any other byte passes, `/` and `\` included: a caller whose name
// must not hold those checks them itself.
bool IsValidName(absl::string_view name);

// "<prefix>.<EscapeToken(aggregate_type)>.<EscapeToken(aggregate_id)>";
// InvalidArgument when the prefix is not valid.
absl::StatusOr<std::string> EventSubject(absl::string_view prefix,
                                         absl::string_view aggregate_type,
                                         absl::string_view aggregate_id);

// The subjects of every aggregate under `prefix`: "<prefix>.>" (what a
// stream binds, a consumer filters).
std::string AllEventsUnder(absl::string_view prefix);

// Whether every subject that `pattern` matches is one that `filter`
// matches (both may hold wildcards: `*` one token, `>` one or more at the
// end). "a.>" covers "a.*.*" and "a.b.>"; "a.*" covers neither.
bool FilterCovers(absl::string_view filter, absl::string_view pattern);

// Whether a stream that binds `stream_subjects` stores every subject
// EventSubject makes under `prefix` ("<prefix>.<type>.<id>"): one of them
// covers "<prefix>.*.*" (a set of filters with a literal type or id among
// them covers no more than the others do).
bool StoresEventsUnder(const std::vector<std::string>& stream_subjects,
                       absl::string_view prefix);

}  // namespace outbox::jetstream
