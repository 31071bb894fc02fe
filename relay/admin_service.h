#pragma once
// outbox.v1.RelayAdmin: the relay's state, dead letters, requeue, a decoded
// look at any outbox row, replay, and the diverged aggregates an operator
// resolves; the subscriptions of the database, paused, resumed or dropped.

#include "common/db.h"
#include "common/identity.h"
#include "outbox/v1/relay.grpc.pb.h"
#include "relay/relay.h"

namespace outbox::relay {

class RelayAdminImpl final : public v1::RelayAdmin::Service {
 public:
  // `db` (the orders database), `relay` and `check` (may be null: every
  // caller admitted) must outlive the service. Requeue, Replay and
  // ResolveDivergence need Access::kAdmin.
  RelayAdminImpl(Database* db, const Relay* relay,
                 const CallerCheck* check = nullptr);

  grpc::Status GetStats(grpc::ServerContext* ctx,
                        const v1::GetRelayStatsRequest* req,
                        v1::RelayStats* resp) override;
  grpc::Status ListDeadLetters(grpc::ServerContext* ctx,
                               const v1::ListDeadLettersRequest* req,
                               v1::ListDeadLettersResponse* resp) override;
  grpc::Status Requeue(grpc::ServerContext* ctx, const v1::RequeueRequest* req,
                       v1::RequeueResponse* resp) override;
  grpc::Status GetEvent(grpc::ServerContext* ctx,
                        const v1::GetEventRequest* req,
                        v1::OutboxRow* resp) override;
  grpc::Status Replay(grpc::ServerContext* ctx, const v1::ReplayRequest* req,
                      v1::ReplayResponse* resp) override;
  grpc::Status ListDivergences(grpc::ServerContext* ctx,
                               const v1::ListDivergencesRequest* req,
                               v1::ListDivergencesResponse* resp) override;
  grpc::Status ResolveDivergence(grpc::ServerContext* ctx,
                                 const v1::ResolveDivergenceRequest* req,
                                 v1::Divergence* resp) override;
  grpc::Status ListSubscriptions(grpc::ServerContext* ctx,
                                 const v1::ListSubscriptionsRequest* req,
                                 v1::ListSubscriptionsResponse* resp) override;
  grpc::Status PauseSubscription(grpc::ServerContext* ctx,
                                 const v1::SubscriptionActionRequest* req,
                                 v1::Subscription* resp) override;
  grpc::Status ResumeSubscription(grpc::ServerContext* ctx,
                                  const v1::SubscriptionActionRequest* req,
                                  v1::Subscription* resp) override;
  grpc::Status DropSubscription(grpc::ServerContext* ctx,
                                const v1::SubscriptionActionRequest* req,
                                v1::DropSubscriptionResponse* resp) override;
  grpc::Status MoveSubscriptionToLog(grpc::ServerContext* ctx,
                                     const v1::SubscriptionActionRequest* req,
                                     v1::Subscription* resp) override;
  grpc::Status MoveSubscriptionToRows(grpc::ServerContext* ctx,
                                      const v1::SubscriptionActionRequest* req,
                                      v1::Subscription* resp) override;

 private:
  // An action on a subscription, after the checks; `info` (all but drop)
  // gets the subscription afterwards, `detail` (drop, moves) what the
  // action recorded.
  grpc::Status Act(grpc::ServerContext* ctx, const char* method,
                   SubscriptionAction action,
                   const v1::SubscriptionActionRequest* req,
                   v1::Subscription* info, std::string* detail);

  Database* const db_;
  const Relay* const relay_;
  const CallerCheck* const check_;
};

}  // namespace outbox::relay
