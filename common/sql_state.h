#pragma once
// The one rule that decides whose fault a PostgreSQL error is. Every
// binary asks it: the consumer to tell a bad event (REJECTED) from a
// misbehaving database (retry later, never count it against the event),
// the producer and the admin services to pick the gRPC status callers see.
//
// The rule goes by SQLSTATE class (the first two characters), with the
// handful of codes inside a class that differ named explicitly:
//
//   class  meaning                                  origin    status
//   22     data exception (bad value, overflow,     kData     INVALID_ARGUMENT
//          bad encoding, too long)
//   23     integrity constraint violation           kData FAILED_PRECONDITION
//          (23505 unique violation)                           (ALREADY_EXISTS)
//   54     program limit exceeded (a value too      kData     INVALID_ARGUMENT
//          large for an index, too many elements)
//   40     transaction rollback: serialization      kConflict ABORTED
//          failure, deadlock (retry at once)
//   08     connection exception                     kWorld    UNAVAILABLE
//   25     invalid transaction state, e.g. 25006    kWorld    UNAVAILABLE
//          read-only transaction (a standby), 25P03
//          idle-in-transaction timeout
//   28     invalid authorization                    kWorld    UNAVAILABLE
//   3D/3F  no such database / schema                kWorld    UNAVAILABLE
//   42     syntax or access rule, e.g. 42501        kWorld    UNAVAILABLE
//          insufficient privilege, 42P01 no table
//   53     insufficient resources: 53100 disk full, kWorld    UNAVAILABLE
//          53200 out of memory, 53300 too many
//          connections
//   55     object not in prerequisite state, e.g.   kWorld    UNAVAILABLE
//          55P03 lock_timeout, 55000 database not
//          accepting connections
//   57     operator intervention: 57014 statement   kWorld    UNAVAILABLE
//          timeout or cancel, 57P01-57P05 shutdown,
//          restart, database dropped
//   58, XX system and internal errors (I/O,         kWorld    UNAVAILABLE
//          corrupt data)
//   other  anything else, and errors without a     kWorld    UNAVAILABLE
//          SQLSTATE (a lost connection, an
//          in-doubt commit)
//
// Unknown means the world: a wrong guess then costs time (a retry), never
// an event. Only the data classes may be blamed on what a request or an
// event carries.

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace outbox {

enum class ErrorOrigin {
  kData,  // the values a statement carried; one request or event is at fault
  kConflict,  // a transaction conflict; the same work succeeds when retried now
  kWorld,     // the database, its configuration or the network; retry later
};

// The origin of an error with SQLSTATE `state` ("" for none).
ErrorOrigin OriginOfSqlState(absl::string_view state);

// The gRPC-compatible status code for SQLSTATE `state` (see the table).
absl::StatusCode CodeForSqlState(absl::string_view state);

// The origin of a status made by StatusFromException (db.h): its SQLSTATE
// decides; a status without one is kWorld.
ErrorOrigin OriginOf(const absl::Status& s);

const char* ErrorOriginName(ErrorOrigin origin);

}  // namespace outbox
