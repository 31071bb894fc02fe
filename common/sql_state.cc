#include "common/sql_state.h"

#include "absl/strings/match.h"
#include "common/db.h"

namespace outbox {

ErrorOrigin OriginOfSqlState(absl::string_view state) {
  if (state.size() != 5) return ErrorOrigin::kWorld;
  const absl::string_view cls = state.substr(0, 2);
  if (cls == "22" || cls == "23" || cls == "54") return ErrorOrigin::kData;
  if (cls == "40") return ErrorOrigin::kConflict;
  return ErrorOrigin::kWorld;
}

absl::StatusCode CodeForSqlState(absl::string_view state) {
  switch (OriginOfSqlState(state)) {
    case ErrorOrigin::kConflict:
      return absl::StatusCode::kAborted;
    case ErrorOrigin::kWorld:
      return absl::StatusCode::kUnavailable;
    case ErrorOrigin::kData:
      break;
  }
  if (state == "23505") return absl::StatusCode::kAlreadyExists;
  if (absl::StartsWith(state, "23"))
    return absl::StatusCode::kFailedPrecondition;
  return absl::StatusCode::kInvalidArgument;
}

ErrorOrigin OriginOf(const absl::Status& s) {
  return OriginOfSqlState(SqlStateOf(s));
}

const char* ErrorOriginName(ErrorOrigin origin) {
  switch (origin) {
    case ErrorOrigin::kData:
      return "data";
    case ErrorOrigin::kConflict:
      return "conflict";
    case ErrorOrigin::kWorld:
      return "world";
  }
  return "?";
}

}  // namespace outbox
