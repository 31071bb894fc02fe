#pragma once
// The relay's ear for commits: a thread of its own holds a LISTEN
// connection on the producer's channel (common/schema.h kNotifyChannel)
// and wakes the worker when a NOTIFY says events committed. It owns that
// connection and thread; the worker only reads and sets the flags below.
//
// Example:
//   CommitListener listener({.url = url, .wake = [&] { relay.Wake(); }});
//   listener.Start();
//   ... the worker: listener.TakeHeard(); claim; ...
//   listener.WantWakes(!every_stream_awaits_an_answer);
//   if (listener.heard()) claim again;
//   if (!listener.works()) poll often;
//
// Behind a transaction pooler LISTEN cannot hear NOTIFY (the pooler hands
// the LISTEN to whichever server session ran it): works() turns false and
// the worker polls. Under steady load, when the worker wants no wakes
// (every stream awaits an answer), the listener stops listening after a
// few NOTIFYs in a row, so the server no longer signals its session for
// every commit, and listens again when wakes are wanted.

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/db.h"

namespace outbox::relay {

class CommitListener {
 public:
  struct Options {
    std::string url;  // where to LISTEN: PostgreSQL itself, not a pooler
    DbSession session;
    // What the worker polls at while no LISTEN works (for the warning).
    absl::Duration fast_poll_interval = absl::Milliseconds(50);
    // Called on the listener's thread: for each NOTIFY while wakes are
    // wanted, each time it begins listening (rows committed while it was
    // not), and when it finds that LISTEN cannot work.
    std::function<void()> wake;
    // For tests: on the listener's thread each time it begins (true) or
    // stops (false) listening.
    std::function<void(bool listening)> on_listening;
  };

  explicit CommitListener(Options options);
  ~CommitListener();  // Stop()
  CommitListener(const CommitListener&) = delete;
  CommitListener& operator=(const CommitListener&) = delete;

  // Starts the thread; at most once.
  void Start();
  // Stops and joins it (within about 200 ms); idempotent.
  void Stop();

  // Whether the worker wants NOTIFYs to wake it; true at first.
  void WantWakes(bool want);
  bool wants_wakes() const { return wants_wakes_; }

  // When the newest NOTIFY since the last TakeHeard arrived (a commit
  // before then is visible to any snapshot taken after), and forgets it;
  // nullopt if none did. Beginning to listen counts as one: rows committed
  // while nobody listened are announced by nothing else.
  std::optional<absl::Time> TakeHeard();
  // Whether TakeHeard has one, without taking it.
  bool heard() const { return heard_at_ != 0; }

  // False while no LISTEN can work (a transaction pooler): poll instead.
  bool works() const { return works_; }
  // Whether a LISTEN is in place now, so that every commit from here on
  // is heard (false: not yet, lost, or stopped under steady load).
  bool hearing() const { return hearing_; }

 private:
  void Run();
  void Heard();

  const Options options_;
  std::atomic<bool> stop_{false};
  // Set true under mu_, with cv_ told: the listener may wait for it.
  std::atomic<bool> wants_wakes_{true};
  // Unix nanoseconds of the newest NOTIFY not taken; 0: none.
  std::atomic<int64_t> heard_at_{0};
  std::atomic<bool> works_{true};
  std::atomic<bool> hearing_{false};
  absl::Mutex mu_;  // with cv_: the listener's wait for wants_wakes_, stop_
  absl::CondVar cv_;
  std::thread thread_;
};

}  // namespace outbox::relay
