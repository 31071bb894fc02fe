#pragma once
// Crash points for failure-injection tests. A binary calls
// MaybeCrash("relay.after_send_before_mark") where a crash is interesting;
// it does nothing unless the environment arms that point:
//
//   OUTBOX_FAULT=relay.after_send_before_mark:0.05,relay.after_mark_commit:0.02
//
// arms each named point with the probability of a crash per pass;
// OUTBOX_FAULT_SEED=N makes the draws repeatable. A crash is
// SIGKILL to the process itself: no destructors, no flushing, like a power
// cut; it first logs "OUTBOX_FAULT: crashing at <point>", which the
// failure-injection suite counts per point. Unarmed, a point costs one load
// and a branch.
//
// Each binary names its points (kRelayCrashPoints, ...) and calls
// CheckCrashPoints at start-up: a name in OUTBOX_FAULT that is not one of
// them (a typo, a renamed point, another binary's) is an error, so that a
// test cannot arm a point that never fires.

#include <vector>

#include "absl/status/status.h"

namespace outbox {

// Every MaybeCrash name, by binary. A point added to the code goes here.
inline const std::vector<const char*> kProducerCrashPoints = {
    "producer.before_commit", "producer.after_commit_before_answer"};
inline const std::vector<const char*> kRelayCrashPoints = {
    "relay.after_claim_before_send", "relay.after_send_before_mark",
    "relay.before_mark_commit", "relay.after_mark_commit"};
inline const std::vector<const char*> kConsumerCrashPoints = {
    "consumer.before_commit", "consumer.after_commit_before_answer"};

// OK when OUTBOX_FAULT is unset or arms only points in `known`, each with a
// probability in [0, 1]; InvalidArgument naming the first entry that is
// not, and the points `known` offers.
absl::Status CheckCrashPoints(const std::vector<const char*>& known);

void MaybeCrash(const char* point);

}  // namespace outbox
