//! Envoy's quota filter (`envoy.filters.http.rate_limit_quota`, the Rate
//! Limit Quota Service client) in end-to-end tests: the bootstrap of
//! `examples/envoy/rlqs/envoy.yaml` rewritten for loopback, an open-loop load
//! generator that records every answer with its time, a bucket-rls started on
//! chosen ports (to come back on the same port after a kill), a scrape of a
//! service's `/metrics`, and a scripted quota server that answers as a test
//! says (to pin what Envoy's client does, independently of bucket-rls).

use super::http::get as http_get;
use super::metrics::metric;
use super::procs::{BucketRls, Proc, bucket_rls_bin, envoy_for_loopback, yaml_file};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    self, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};
use futures::StreamExt;
use serde_json::Value;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// A path under `examples/envoy/rlqs/`.
pub fn example(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/envoy/rlqs")
        .join(rel)
}

/// The example's Envoy bootstrap on loopback: listener and admin on port 0,
/// the `bucket_rls` cluster on `quota` (the quota stream goes to the first
/// healthy endpoint, round robin), the `upstream` cluster on `upstream`.
pub fn quota_envoy(quota: &[SocketAddr], upstream: SocketAddr) -> Value {
    envoy_for_loopback(
        yaml_file(&example("envoy.yaml")),
        &[("bucket_rls", quota), ("upstream", &[upstream])],
    )
}

/// Every `RateLimitQuotaBucketSettings` of the bootstrap's quota filter (the
/// per-tenant matcher's and the `on_no_match` one), to change them in a test.
pub fn bucket_settings(bootstrap: &mut Value) -> Vec<&mut Value> {
    let hcm = &mut bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"];
    let filter = hcm["http_filters"]
        .as_array_mut()
        .expect("http_filters")
        .iter_mut()
        .find(|f| f["name"] == "envoy.filters.http.rate_limit_quota")
        .expect("rate_limit_quota filter in the example");
    let m = &mut filter["typed_config"]["bucket_matchers"];
    let (list, no_match) = {
        let obj = m.as_object_mut().expect("bucket_matchers");
        let mut list = None;
        let mut no_match = None;
        for (k, v) in obj.iter_mut() {
            match k.as_str() {
                "matcher_list" => list = Some(v),
                "on_no_match" => no_match = Some(v),
                _ => {}
            }
        }
        (list.expect("matcher_list"), no_match.expect("on_no_match"))
    };
    let mut out: Vec<&mut Value> = list["matchers"]
        .as_array_mut()
        .expect("matchers")
        .iter_mut()
        .map(|m| &mut m["on_match"]["action"]["typed_config"])
        .collect();
    out.push(&mut no_match["action"]["typed_config"]);
    out
}

/// An upstream answering `200 ok` to everything, inside the test process.
pub async fn upstream() -> SocketAddr {
    let app = axum::Router::new().fallback(|| async { "ok\n" });
    let listener = tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
        .await
        .expect("bind upstream");
    let addr = listener.local_addr().expect("upstream addr");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("upstream server") });
    addr
}

/// `bucket-rls serve` on the given ports (so a test can start it again on
/// the port Envoy knows), waiting for `/healthcheck`.
pub async fn start_rls_on(
    config: &Path,
    grpc: SocketAddr,
    http: SocketAddr,
    extra: &[&str],
) -> BucketRls {
    BucketRls::start_on(config, grpc, http, extra).await
}

/// The service's Prometheus text (`GET /metrics` on its admin port).
pub async fn scrape(http: SocketAddr) -> String {
    let r = http_get(http, "/metrics", &[])
        .await
        .unwrap_or_else(|e| panic!("GET /metrics on {http}: {e}"));
    assert_eq!(r.status, 200, "GET /metrics: {r:?}");
    r.body
}

/// The usage-report messages a service has received
/// (`bucket_rls_rlqs_reports_total`, 0 when the series is absent).
pub async fn reports_received(http: SocketAddr) -> f64 {
    metric(&scrape(http).await, "bucket_rls_rlqs_reports_total", &[]).unwrap_or(0.0)
}

/// One answer of a load run.
#[derive(Debug, Clone, Copy)]
pub struct Answer {
    /// When the request was sent, from the start of the run.
    pub at: Duration,
    /// Index of the target it went to.
    pub target: usize,
    /// HTTP status; 0 when the request failed (connection, timeout).
    pub status: u16,
}

/// Every answer of a load run.
#[derive(Debug, Default, Clone)]
pub struct Answers(pub Vec<Answer>);

impl Answers {
    /// Answers with `status` from `target` (`None`: every target) sent in
    /// `[from, to)`.
    pub fn count(&self, target: Option<usize>, status: u16, from: Duration, to: Duration) -> usize {
        self.0
            .iter()
            .filter(|a| {
                target.is_none_or(|t| a.target == t)
                    && a.status == status
                    && a.at >= from
                    && a.at < to
            })
            .count()
    }

    /// Admitted (200) answers of `target` (`None`: all) over the whole run.
    pub fn admitted(&self, target: Option<usize>) -> usize {
        self.count(target, 200, Duration::ZERO, Duration::MAX)
    }

    /// Denied (429) answers of `target` (`None`: all) over the whole run.
    pub fn denied(&self, target: Option<usize>) -> usize {
        self.count(target, 429, Duration::ZERO, Duration::MAX)
    }

    /// Answers that are neither 200 nor 429 (failed requests included).
    pub fn others(&self) -> Vec<Answer> {
        self.0
            .iter()
            .filter(|a| a.status != 200 && a.status != 429)
            .copied()
            .collect()
    }

    /// Admitted answers of `target` per whole second of the run.
    pub fn admitted_per_second(&self, target: Option<usize>, seconds: u64) -> Vec<usize> {
        (0..seconds)
            .map(|s| {
                self.count(
                    target,
                    200,
                    Duration::from_secs(s),
                    Duration::from_secs(s + 1),
                )
            })
            .collect()
    }
}

/// Offers each `(listener, rate per second)` its rate for `duration`, open
/// loop (a request is sent on schedule whatever the earlier ones are doing,
/// each on a new connection), with `headers` on every request; waits for
/// every answer. A rate of 0 sends nothing to that target.
pub async fn drive(
    targets: &[(SocketAddr, f64)],
    duration: Duration,
    headers: &[(&str, &str)],
) -> Answers {
    let start = tokio::time::Instant::now();
    let headers: Arc<Vec<(String, String)>> = Arc::new(
        headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    );
    let mut tasks = Vec::new();
    for (i, &(addr, rate)) in targets.iter().enumerate() {
        if rate <= 0.0 {
            continue;
        }
        let headers = headers.clone();
        tasks.push(tokio::spawn(async move {
            let n = (rate * duration.as_secs_f64()).round() as u64;
            let mut reqs = Vec::new();
            for k in 0..n {
                let at = Duration::from_secs_f64(k as f64 / rate);
                tokio::time::sleep_until(start + at).await;
                let headers = headers.clone();
                reqs.push(tokio::spawn(async move {
                    let h: Vec<(&str, &str)> = headers
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    let status = http_get(addr, "/", &h).await.map_or(0, |r| r.status);
                    Answer {
                        at,
                        target: i,
                        status,
                    }
                }));
            }
            let mut out = Vec::new();
            for r in reqs {
                out.push(r.await.expect("request task"));
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("load task"));
    }
    all.sort_by_key(|a| a.at);
    Answers(all)
}

/// A token bucket strategy for a scripted assignment: `max_tokens`,
/// `tokens_per_fill` every `fill_secs` whole seconds.
pub fn token_bucket(max_tokens: u32, tokens_per_fill: u32, fill_secs: i64) -> RateLimitStrategy {
    use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;
    RateLimitStrategy {
        strategy: Some(Strategy::TokenBucket(TokenBucket {
            max_tokens,
            tokens_per_fill: Some(UInt32Value {
                value: tokens_per_fill,
            }),
            fill_interval: Some(PbDuration {
                seconds: fill_secs,
                nanos: 0,
            }),
        })),
    }
}

/// What the scripted quota server saw and what it answers.
#[derive(Default)]
struct FakeState {
    /// Each usage-report message with the time it arrived.
    reports: Vec<(Instant, RateLimitQuotaUsageReports)>,
    /// Answer to every report: this strategy for each reported bucket, with
    /// this time to live (none: no answer).
    answer: Option<(RateLimitStrategy, Duration)>,
    /// The open streams' senders, for pushes.
    streams: Vec<mpsc::Sender<Result<RateLimitQuotaResponse, tonic::Status>>>,
}

/// A quota server on loopback that records every usage report and answers
/// each one with the assignment the test set (for every bucket in it), or
/// not at all; [`FakeQuota::push`] sends an assignment at once.
#[derive(Clone)]
pub struct FakeQuota {
    state: Arc<Mutex<FakeState>>,
    /// Its gRPC address.
    pub addr: SocketAddr,
}

#[tonic::async_trait]
impl RateLimitQuotaService for FakeQuota {
    type StreamRateLimitQuotasStream =
        Pin<Box<dyn futures::Stream<Item = Result<RateLimitQuotaResponse, tonic::Status>> + Send>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: tonic::Request<tonic::Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<tonic::Response<Self::StreamRateLimitQuotasStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(64);
        self.state.lock().expect("state").streams.push(tx.clone());
        let state = self.state.clone();
        tokio::spawn(async move {
            while let Some(Ok(msg)) = inbound.next().await {
                let reply = {
                    let mut s = state.lock().expect("state");
                    s.reports.push((Instant::now(), msg.clone()));
                    s.answer.map(|(strategy, ttl)| {
                        assignment(
                            msg.bucket_quota_usages
                                .iter()
                                .filter_map(|u| u.bucket_id.clone()),
                            &strategy,
                            ttl,
                        )
                    })
                };
                if let Some(r) = reply
                    && tx.send(Ok(r)).await.is_err()
                {
                    break;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// One response assigning `strategy` with `ttl` to each bucket.
fn assignment(
    buckets: impl Iterator<Item = envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId>,
    strategy: &RateLimitStrategy,
    ttl: Duration,
) -> RateLimitQuotaResponse {
    RateLimitQuotaResponse {
        bucket_action: buckets
            .map(|id| BucketAction {
                bucket_id: Some(id),
                bucket_action: Some(bucket_action::BucketAction::QuotaAssignmentAction(
                    QuotaAssignmentAction {
                        assignment_time_to_live: Some(PbDuration {
                            seconds: i64::try_from(ttl.as_secs()).expect("ttl"),
                            nanos: i32::try_from(ttl.subsec_nanos()).expect("ttl"),
                        }),
                        rate_limit_strategy: Some(*strategy),
                    },
                )),
            })
            .collect(),
    }
}

impl FakeQuota {
    /// Starts the server on a free loopback port.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind fake quota server");
        let addr = listener.local_addr().expect("addr");
        let me = Self {
            state: Arc::default(),
            addr,
        };
        let svc = RateLimitQuotaServiceServer::new(me.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .expect("fake quota server");
        });
        me
    }

    /// From now on, answer every report with `strategy` (time to live `ttl`)
    /// for each bucket it lists; `None`: do not answer.
    pub fn answer_with(&self, answer: Option<(RateLimitStrategy, Duration)>) {
        self.state.lock().expect("state").answer = answer;
    }

    /// Sends `strategy` for every bucket reported so far, on every open
    /// stream, now.
    pub async fn push(&self, strategy: &RateLimitStrategy, ttl: Duration) {
        let (streams, ids) = {
            let s = self.state.lock().expect("state");
            let mut ids = Vec::new();
            for (_, r) in &s.reports {
                for u in &r.bucket_quota_usages {
                    if let Some(id) = &u.bucket_id
                        && !ids.contains(id)
                    {
                        ids.push(id.clone());
                    }
                }
            }
            (s.streams.clone(), ids)
        };
        let msg = assignment(ids.into_iter(), strategy, ttl);
        for tx in streams {
            let _ = tx.send(Ok(msg.clone())).await;
        }
    }

    /// Every report received so far, with its arrival time.
    pub fn reports(&self) -> Vec<(Instant, RateLimitQuotaUsageReports)> {
        self.state.lock().expect("state").reports.clone()
    }
}
