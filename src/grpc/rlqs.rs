//! Envoy's Rate Limit Quota Service on the gRPC port:
//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas`,
//! a tonic service among the [`fallback_routes`](super::fallback_routes).
//! It maps protos to the core's quota operation and back, and nothing
//! below it names a proto (docs/design.md, "Quota sharing").
//!
//! A stream: the first message binds its domain ([`Limiter::quota_stream`]);
//! each usage report message is one [`QuotaStream::report`] call, answered
//! by one response with an action per bucket reported (an identical
//! assignment sent again only restarts its time to live in Envoy). While
//! a bucket's part is cut below what it is due (the other subscribers still
//! hold more than their targets), the stream checks it again every
//! [`RECHECK_INTERVAL`] ([`QuotaStream::recheck`]) and sends an assignment
//! that grew without waiting for Envoy's next report. A
//! malformed message ends the stream with `INVALID_ARGUMENT` naming the
//! problem; a storage failure skips that answer (Envoy keeps its
//! assignments until they expire) and the stream goes on. On shutdown every
//! open stream sends its assignments again with a time to live of 0, then
//! closes with `OK`. However a stream ends, its subscriber records leave
//! storage at once.

use crate::limiter::Limiter;
use crate::limiter::quota::{
    Action, Answer, BucketAnswer, QuotaError, QuotaStream, RECHECK_INTERVAL, Usage,
};
use crate::metrics as m;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::{
    BucketAction, bucket_action,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket, rate_limit_strategy};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::{Request, Response, Status, Streaming};

/// The tonic service answering `StreamRateLimitQuotas` from a [`Limiter`].
#[derive(Debug, Clone)]
pub struct Rlqs(Arc<Limiter>);

impl Rlqs {
    /// The tonic server of the service, for [`tonic::service::Routes`].
    #[must_use]
    pub fn server(limiter: Arc<Limiter>) -> RateLimitQuotaServiceServer<Self> {
        RateLimitQuotaServiceServer::new(Self(limiter))
            .max_decoding_message_size(super::MAX_MESSAGE_BYTES)
    }
}

type Answers = Pin<Box<dyn futures::Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for Rlqs {
    type StreamRateLimitQuotasStream = Answers;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Answers>, Status> {
        let headers = request.metadata().clone().into_headers();
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(serve_stream(self.0.clone(), headers, inbound, tx));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// Runs one stream until the client ends it, a message is malformed, or
/// the service shuts down; then the stream's subscriber records leave
/// storage ([`QuotaStream::leave`]) so that the other Envoys' next reports
/// share what it held.
async fn serve_stream(
    limiter: Arc<Limiter>,
    headers: http::HeaderMap,
    mut inbound: Streaming<RateLimitQuotaUsageReports>,
    tx: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
) {
    let mut closing = limiter.quotas().closing();
    let mut stream: Option<QuotaStream> = None;
    // When a bucket of the stream waits for its part (cut below what it is
    // due): the next recheck.
    let mut recheck: Option<Instant> = None;
    loop {
        let msg = tokio::select! {
            closed = closing.wait_for(|c| *c) => {
                let _ = closed.map(|_| ());
                None
            }
            () = tx.closed() => break,
            () = tokio::time::sleep_until(recheck.unwrap_or_else(Instant::now)), if recheck.is_some() => {
                Some(None)
            }
            msg = inbound.message() => Some(Some(msg)),
        };
        if let Some(None) = msg {
            recheck = None;
            if let Some(s) = stream.as_mut() {
                match s.recheck().await {
                    Ok(answers) if !answers.is_empty() => {
                        if tx.send(Ok(response(&answers))).await.is_err() {
                            break;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => tracing::debug!(subscriber = %s.subscriber(), error = %e,
                        "quota recheck failed; the bucket waits for the next one"),
                }
                recheck = s.waiting().then(|| Instant::now() + RECHECK_INTERVAL);
            }
            continue;
        }
        let msg = msg.flatten();
        let Some(msg) = msg else {
            if let Some(s) = &stream {
                let answers = s.expire_all();
                if !answers.is_empty() {
                    let _ = tx.send(Ok(response(&answers))).await;
                }
            }
            break;
        };
        let msg = match msg {
            Ok(Some(msg)) => msg,
            Ok(None) | Err(_) => break,
        };
        metrics::counter!(m::RLQS_REPORTS).increment(1);
        match handle(&limiter, &headers, &mut stream, &msg).await {
            Ok(Some(answer)) => {
                if tx.send(Ok(answer)).await.is_err() {
                    break;
                }
            }
            Ok(None) => {}
            Err(status) => {
                let _ = tx.send(Err(status)).await;
                break;
            }
        }
        recheck = stream
            .as_ref()
            .filter(|s| s.waiting())
            .map(|_| Instant::now() + RECHECK_INTERVAL);
    }
    if let Some(mut s) = stream
        && let Err(e) = s.leave().await
    {
        tracing::debug!(subscriber = %s.subscriber(), error = %e,
            "quota subscriber records not removed; they expire on their own");
    }
}

/// One usage report: binds the domain on the first message, then asks the
/// core. `Ok(None)`: nothing to send (no bucket, or storage failed).
async fn handle(
    limiter: &Arc<Limiter>,
    headers: &http::HeaderMap,
    stream: &mut Option<QuotaStream>,
    msg: &RateLimitQuotaUsageReports,
) -> Result<Option<RateLimitQuotaResponse>, Status> {
    let s = match stream {
        Some(s) => {
            if !msg.domain.is_empty() && msg.domain != s.domain() {
                return Err(Status::invalid_argument(format!(
                    "the stream is bound to domain {:?}; a report names {:?}",
                    s.domain(),
                    msg.domain
                )));
            }
            s
        }
        None => stream.insert(limiter.quota_stream(&msg.domain).map_err(|e| status(&e))?),
    };
    let mut entries: Vec<Vec<(&str, &str)>> = Vec::with_capacity(msg.bucket_quota_usages.len());
    for u in &msg.bucket_quota_usages {
        let Some(id) = &u.bucket_id else {
            return Err(Status::invalid_argument("a bucket usage has no bucket id"));
        };
        entries.push(
            id.bucket
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect(),
        );
    }
    let usages: Vec<Usage<'_>> = msg
        .bucket_quota_usages
        .iter()
        .zip(&entries)
        .map(|(u, e)| Usage {
            bucket: e,
            allowed: u.num_requests_allowed,
            denied: u.num_requests_denied,
        })
        .collect();
    if usages.is_empty() {
        return Ok(None);
    }
    let domain = s.domain().to_owned();
    let result = crate::otel::quota_report(headers, &domain, usages.len(), s.report(&usages)).await;
    match result {
        Ok(answers) => Ok(Some(response(&answers))),
        Err(e @ (QuotaError::Storage(_) | QuotaError::NoConfig)) => {
            tracing::warn!(domain = %crate::limiter::labels::ValueLabels::clip(&domain), error = %e,
                "quota report not answered; Envoy keeps its assignments until they expire");
            Ok(None)
        }
        Err(e) => Err(status(&e)),
    }
}

/// The gRPC status of a quota error that ends the stream.
fn status(e: &QuotaError) -> Status {
    match e {
        QuotaError::Invalid(m) => Status::invalid_argument(m.clone()),
        QuotaError::Exhausted(m) => Status::resource_exhausted(m.clone()),
        QuotaError::NoConfig | QuotaError::Storage(_) => Status::unavailable(e.to_string()),
    }
}

/// The response carrying `answers`, counting the assignments in it.
fn response(answers: &[BucketAnswer]) -> RateLimitQuotaResponse {
    let bucket_action = answers.iter().map(bucket_action).collect();
    let assignments = answers
        .iter()
        .filter(|a| matches!(a.answer, Answer::Assign { .. }))
        .count();
    metrics::counter!(m::RLQS_ASSIGNMENTS).increment(assignments as u64);
    RateLimitQuotaResponse { bucket_action }
}

/// One answer as Envoy's `BucketAction`.
fn bucket_action(a: &BucketAnswer) -> BucketAction {
    let bucket_id = Some(BucketId {
        bucket: a.bucket.iter().cloned().collect(),
    });
    let action = match a.answer {
        Answer::Abandon => {
            bucket_action::BucketAction::AbandonAction(bucket_action::AbandonAction {})
        }
        Answer::Assign { action, ttl } => bucket_action::BucketAction::QuotaAssignmentAction(
            bucket_action::QuotaAssignmentAction {
                assignment_time_to_live: Some(PbDuration {
                    seconds: i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX),
                    nanos: 0,
                }),
                rate_limit_strategy: Some(strategy(action)),
            },
        ),
    };
    BucketAction {
        bucket_id,
        bucket_action: Some(action),
    }
}

/// An action as Envoy's `RateLimitStrategy`.
fn strategy(action: Action) -> RateLimitStrategy {
    use rate_limit_strategy::{BlanketRule, Strategy};
    let s = match action {
        Action::AllowAll => Strategy::BlanketRule(BlanketRule::AllowAll as i32),
        Action::DenyAll => Strategy::BlanketRule(BlanketRule::DenyAll as i32),
        Action::TokenBucket {
            max_tokens,
            tokens_per_fill,
            fill_interval_secs,
        } => Strategy::TokenBucket(TokenBucket {
            max_tokens,
            tokens_per_fill: Some(UInt32Value {
                value: tokens_per_fill,
            }),
            fill_interval: Some(PbDuration {
                seconds: i64::try_from(fill_interval_secs).unwrap_or(i64::MAX),
                nanos: 0,
            }),
        }),
    };
    RateLimitStrategy { strategy: Some(s) }
}
