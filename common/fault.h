#pragma once
// Crash points for failure-injection tests. A binary calls
// MaybeCrash("relay.after_send_before_mark") where a crash is interesting;
// it does nothing unless the environment arms that point:
//
//   OUTBOX_FAULT=relay.after_send_before_mark:0.05,consumer.after_commit_before_answer:0.02
//
// arms each named point with the probability of a crash per pass;
// OUTBOX_FAULT_SEED=N makes the draws repeatable. A crash is
// SIGKILL to the process itself: no destructors, no flushing, like a power
// cut. Unarmed, a point costs one load and a branch.

namespace outbox {

void MaybeCrash(const char* point);

}  // namespace outbox
