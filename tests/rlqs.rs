//! Envoy's quota service (`StreamRateLimitQuotas`) in process: the service
//! served on loopback by `app::run`, a tonic client generated from Envoy's
//! protos sending usage reports and reading assignments, over the memory
//! backend and over a real Redis shared by two replicas.

mod common;

use bucket_rls::app::{self, Listeners};
use bucket_rls::limiter::Limiter;
use bucket_rls::settings::ServiceSettings;
use bucket_rls::storage::Storage;
use bucket_rls::storage::memory::MemoryStorage;
use bucket_rls::storage::redis::RedisStorage;
use common::redis::RedisServer;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::Streaming;

const YAML: &str = "
domain: edge
descriptors:
  - key: tenant
    rate_limit: { unit: second, requests_per_unit: 100 }
";

struct Server {
    grpc: SocketAddr,
    http: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<()>,
}

async fn serve(limiter: Arc<Limiter>) -> Server {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (g, h) = (grpc.local_addr().unwrap(), http.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let done = tokio::spawn(async move {
        app::run(Listeners { grpc, http }, limiter, async move {
            let _ = stopped.await;
        })
        .await
        .expect("serves");
    });
    Server {
        grpc: g,
        http: h,
        stop: Some(stop),
        done,
    }
}

fn limiter(storage: Arc<dyn Storage>, prefix: &str, deny_unmatched: bool) -> Arc<Limiter> {
    // The recorder first: a gauge raised before it exists and lowered after
    // would throw off the stream counts other tests of this binary read.
    bucket_rls::metrics::install();
    let settings = ServiceSettings {
        key_prefix: prefix.to_owned(),
        rlqs_deny_unmatched: deny_unmatched,
        ..ServiceSettings::default()
    };
    Arc::new(Limiter::new(
        common::config(&[("t.yaml", YAML)]),
        storage,
        settings,
    ))
}

/// An open quota stream: send reports, read responses.
struct Stream {
    tx: mpsc::Sender<RateLimitQuotaUsageReports>,
    rx: Streaming<RateLimitQuotaResponse>,
}

async fn open(addr: SocketAddr) -> Stream {
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let (tx, rx) = mpsc::channel(8);
    let rx = client
        .stream_rate_limit_quotas(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    Stream { tx, rx }
}

/// One bucket of a report: its id's entries, allowed, denied.
type Entry<'a> = (&'a [(&'a str, &'a str)], u64, u64);

fn report(domain: &str, buckets: &[Entry<'_>]) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: domain.into(),
        bucket_quota_usages: buckets
            .iter()
            .map(|(id, allowed, denied)| BucketQuotaUsage {
                bucket_id: Some(BucketId {
                    bucket: id
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect(),
                }),
                time_elapsed: Some(envoy_types::pb::google::protobuf::Duration {
                    seconds: 0,
                    nanos: 0,
                }),
                num_requests_allowed: *allowed,
                num_requests_denied: *denied,
            })
            .collect(),
    }
}

impl Stream {
    async fn send(
        &mut self,
        r: RateLimitQuotaUsageReports,
    ) -> Result<RateLimitQuotaResponse, tonic::Status> {
        self.tx.send(r).await.expect("stream open");
        match tokio::time::timeout(Duration::from_secs(10), self.rx.message()).await {
            Ok(Ok(Some(m))) => Ok(m),
            Ok(Ok(None)) => panic!("the stream ended"),
            Ok(Err(s)) => Err(s),
            Err(_) => panic!("no answer within 10 s"),
        }
    }
}

/// `(max_tokens, tokens_per_fill, fill_interval s, ttl s)` of a token
/// bucket assignment; the blanket rule as `Err`.
fn bucket(r: &RateLimitQuotaResponse, i: usize) -> Result<(u32, u32, i64, i64), i32> {
    let Some(Action::QuotaAssignmentAction(a)) = &r.bucket_action[i].bucket_action else {
        panic!("not an assignment: {r:?}");
    };
    let ttl = a.assignment_time_to_live.expect("ttl").seconds;
    match a
        .rate_limit_strategy
        .as_ref()
        .and_then(|s| s.strategy.as_ref())
    {
        Some(Strategy::TokenBucket(t)) => Ok((
            t.max_tokens,
            t.tokens_per_fill.expect("tokens per fill").value,
            t.fill_interval.expect("fill interval").seconds,
            ttl,
        )),
        Some(Strategy::BlanketRule(b)) => Err(*b),
        other => panic!("strategy {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_streams_share_one_rule_and_close_with_ttl_zero() {
    let l = limiter(Arc::new(MemoryStorage::default()), "q:", false);
    let mut server = serve(l.clone()).await;
    let mut a = open(server.grpc).await;
    let mut b = open(server.grpc).await;
    let acme: &[(&str, &str)] = &[("tenant", "acme")];
    let r = a
        .send(report("edge", &[(acme, 1, 0), (&[("other", "x")], 1, 0)]))
        .await
        .expect("answer");
    // Alone: the whole rule (100/s: 100 tokens a 1 s fill, burst 100), 15 s.
    assert_eq!(bucket(&r, 0), Ok((100, 100, 1, 15)));
    // No rule: the blanket rule, allow by default.
    assert_eq!(bucket(&r, 1), Err(BlanketRule::AllowAll as i32));
    let r = b
        .send(report("edge", &[(acme, 1, 0)]))
        .await
        .expect("answer");
    // a holds all 100 until it reports again: b gets what is left, nothing
    // (sent as deny-all).
    assert_eq!(bucket(&r, 0), Err(BlanketRule::DenyAll as i32));
    // Both report alike: within a few reports both hold about half.
    let (mut ma, mut mb) = (0, 0);
    for _ in 0..3 {
        let r = a
            .send(report("edge", &[(acme, 10, 0)]))
            .await
            .expect("answer");
        let (m, ta) = bucket(&r, 0).map_or((0, 0), |(m, t, _, _)| (m, t));
        ma = m;
        let r = b
            .send(report("edge", &[(acme, 10, 0)]))
            .await
            .expect("answer");
        let (m, tb) = bucket(&r, 0).map_or((0, 0), |(m, t, _, _)| (m, t));
        mb = m;
        assert!(ma + mb <= 100 && ta + tb <= 100, "{ma}+{mb}, {ta}+{tb}");
    }
    assert!(ma >= 40 && mb >= 40, "{ma}, {mb}");

    // The admin view lists both subscribers of the bucket.
    let body = common::http::request(server.http, "GET", "/rlqs", None)
        .await
        .body;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    let streams = v["streams"].as_array().expect("streams");
    assert_eq!(streams.len(), 2, "{body}");
    assert_eq!(
        streams[0]["buckets"]["tenant=acme"]["subscribers"]
            .as_array()
            .map(Vec::len),
        Some(2),
        "{body}"
    );
    let metrics = common::http::request(server.http, "GET", "/metrics", None)
        .await
        .body;
    // (Other tests of this binary count in the same recorder.)
    let value = |name: &str| common::metrics::metric(&metrics, name, &[]).unwrap_or(0.0);
    assert!(value("bucket_rls_rlqs_reports_total") >= 8.0, "{metrics}");
    assert!(value("bucket_rls_rlqs_streams") >= 2.0, "{metrics}");
    assert!(
        value("bucket_rls_rlqs_assignments_total") >= 8.0,
        "{metrics}"
    );
    assert!(
        common::metrics::metric(
            &metrics,
            "bucket_rls_rlqs_subscribers",
            &[("rule", "edge.tenant")]
        )
        .is_some(),
        "{metrics}"
    );

    // Shutdown: every stream gets its assignments again with TTL 0, then ends.
    drop(server.stop.take());
    for s in [&mut a, &mut b] {
        let m = tokio::time::timeout(Duration::from_secs(10), s.rx.message())
            .await
            .expect("in time")
            .expect("ok")
            .expect("a last message");
        for i in 0..m.bucket_action.len() {
            let ttl = match &m.bucket_action[i].bucket_action {
                Some(Action::QuotaAssignmentAction(x)) => x.assignment_time_to_live.expect("ttl"),
                other => panic!("{other:?}"),
            };
            assert_eq!((ttl.seconds, ttl.nanos), (0, 0));
        }
        let end = tokio::time::timeout(Duration::from_secs(10), s.rx.message())
            .await
            .expect("in time");
        assert!(matches!(end, Ok(None)), "{end:?}");
    }
    drop((a, b));
    tokio::time::timeout(Duration::from_secs(15), server.done)
        .await
        .expect("drained")
        .expect("ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_reports_end_only_their_stream() {
    let l = limiter(Arc::new(MemoryStorage::default()), "q:", true);
    let server = serve(l).await;
    let mut good = open(server.grpc).await;
    let r = good
        .send(report("edge", &[(&[("nothing", "x")], 1, 0)]))
        .await
        .expect("answer");
    assert_eq!(bucket(&r, 0), Err(BlanketRule::DenyAll as i32));
    for (bad, words) in [
        (report("", &[(&[("tenant", "a")], 1, 0)]), "no domain"),
        (report("edge", &[(&[], 1, 0)]), "no entries"),
        (report("edge", &[(&[("", "v")], 1, 0)]), "empty key"),
    ] {
        let mut s = open(server.grpc).await;
        let e = s.send(bad).await.expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains(words), "{}", e.message());
    }
    // The other stream and ShouldRateLimit keep serving.
    let r = good
        .send(report("edge", &[(&[("tenant", "a")], 1, 0)]))
        .await
        .expect("answer");
    assert!(bucket(&r, 0).is_ok());
    let mut rls = RateLimitServiceClient::connect(format!("http://{}", server.grpc))
        .await
        .expect("connect");
    let r = rls
        .should_rate_limit(common::req(
            "edge",
            vec![common::desc(&[("tenant", "a")])],
            1,
        ))
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
}

/// Two replicas over one Redis: each sees the other's subscriber, the
/// shares sum within the rule, and the allowed counts reach the bucket
/// ShouldRateLimit charges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_replicas_share_subscribers_and_the_bucket() {
    let redis = RedisServer::start();
    let storage = || -> Arc<dyn Storage> {
        Arc::new(
            RedisStorage::builder(redis.url())
                .timeout(Duration::from_secs(2))
                .build()
                .expect("valid URL"),
        )
    };
    let one = serve(limiter(storage(), "q:", false)).await;
    let two = serve(limiter(storage(), "q:", false)).await;
    let mut a = open(one.grpc).await;
    let mut b = open(two.grpc).await;
    let acme: &[(&str, &str)] = &[("tenant", "acme")];
    a.send(report("edge", &[(acme, 1, 0)]))
        .await
        .expect("answer");
    b.send(report("edge", &[(acme, 1, 0)]))
        .await
        .expect("answer");
    let (mut ma, mut mb) = (0, 0);
    for _ in 0..3 {
        let r = a
            .send(report("edge", &[(acme, 10, 0)]))
            .await
            .expect("answer");
        let (m, ta) = bucket(&r, 0).map_or((0, 0), |(m, t, _, _)| (m, t));
        ma = m;
        let r = b
            .send(report("edge", &[(acme, 10, 0)]))
            .await
            .expect("answer");
        let (m, tb) = bucket(&r, 0).map_or((0, 0), |(m, t, _, _)| (m, t));
        mb = m;
        assert!(ma + mb <= 100 && ta + tb <= 100, "{ma}+{mb}, {ta}+{tb}");
    }
    assert!(ma >= 40 && mb >= 40, "{ma}, {mb}");
    // One subscriber record hash beside the bucket, under the prefix, expiring.
    let keys: Vec<String> = redis.query(redis::cmd("KEYS").arg("q:q*"));
    assert_eq!(keys.len(), 1, "{keys:?}");
    let fields: u64 = redis.query(redis::cmd("HLEN").arg(&keys[0]));
    assert_eq!(fields, 2);
    let ttl: i64 = redis.query(redis::cmd("PTTL").arg(&keys[0]));
    assert!(ttl > 0 && ttl <= 15_000, "{ttl}");
    // 62 allowed were charged (within a second): ShouldRateLimit sees
    // about 38 left.
    let mut rls = RateLimitServiceClient::connect(format!("http://{}", one.grpc))
        .await
        .expect("connect");
    let r = rls
        .should_rate_limit(common::req(
            "edge",
            vec![common::desc(&[("tenant", "acme")])],
            1,
        ))
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
    let left = r.statuses[0].limit_remaining;
    assert!((37..=99).contains(&left), "{left}");
}

/// Through Sentinel: the discovered master keeps the subscriber records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_master_keeps_the_records() {
    use bucket_rls::storage::redis::sentinel::RedisSentinelStorage;
    use common::sentinel::{MASTER_NAME, SentinelSetup};
    let setup = SentinelSetup::start();
    let s = RedisSentinelStorage::builder(setup.sentinel_addrs(), MASTER_NAME)
        .timeout(Duration::from_secs(2))
        .build()
        .expect("valid Sentinels");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.master_addr().is_none() {
        assert!(std::time::Instant::now() < deadline, "no master discovered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let server = serve(limiter(Arc::new(s), "q:", false)).await;
    let mut a = open(server.grpc).await;
    let acme: &[(&str, &str)] = &[("tenant", "acme")];
    let r = a
        .send(report("edge", &[(acme, 3, 0)]))
        .await
        .expect("answer");
    assert_eq!(bucket(&r, 0), Ok((100, 100, 1, 15)));
    let fields: u64 = setup
        .data_node(setup.master_port())
        .query(redis::cmd("HLEN").arg("q:qd4:edge|k6:tenant=v4:acme"));
    assert_eq!(fields, 1);
}

/// `Storage::report` on Redis (the quota script) answers as the memory
/// backend does: the charge with debt, the records, their expiry.
#[tokio::test]
async fn quota_script_matches_the_memory_backend() {
    use bucket_rls::storage::clock::ManualClock;
    use bucket_rls::storage::quota::{Held, QuotaReport};
    use bucket_rls::storage::{BucketLimit, ChargeKind, ChargeSpec, Limit};
    let redis = RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let mem = MemoryStorage::new(Arc::new(clock.clone()));
    let red = RedisStorage::builder(redis.url())
        .timeout(Duration::from_secs(2))
        .test_clock(Arc::new(clock.clone()))
        .build()
        .expect("valid URL");
    let entry = |sub: &str, cost: u64, demand: u64, held: Option<Held>| QuotaReport {
        bucket: "t:d1:e|k1:k=v1:v".into(),
        subscribers: "t:qd1:e|k1:k=v1:v".into(),
        charge: ChargeSpec {
            limit: Limit::TokenBucket(BucketLimit {
                requests_per_unit: 10,
                unit_secs: std::num::NonZeroU64::MIN,
                burst: 10,
                max_debt: 60,
            }),
            cost,
            kind: ChargeKind::Consume,
            shadow: false,
        },
        subscriber: sub.into(),
        demand_milli: demand,
        held,
        budget: Held {
            tokens_per_fill: 10,
            max_tokens: 10,
        },
        live_ms: 15_000,
    };
    let held = Some(Held {
        tokens_per_fill: 5,
        max_tokens: 5,
    });
    let steps: Vec<(u64, QuotaReport)> = vec![
        (0, entry("a", 4, 1_000, None)),
        (0, entry("b", 30, 2_500, held)),
        (500, entry("a", 0, 500, held)),
        (10_000, entry("b", 100, 0, None)),
        (6_000, entry("b", 1, 7, held)),
        // Everyone above expired: a single token held with a part of the
        // rate is not counted against the burst, so d keeps all 10.
        (
            20_000,
            entry(
                "c",
                0,
                1,
                Some(Held {
                    tokens_per_fill: 1,
                    max_tokens: 1,
                }),
            ),
        ),
        (
            0,
            entry(
                "d",
                0,
                9_000,
                Some(Held {
                    tokens_per_fill: 9,
                    max_tokens: 10,
                }),
            ),
        ),
    ];
    for (advance_ms, e) in steps {
        clock.advance(Duration::from_millis(advance_ms));
        let m = mem.report(std::slice::from_ref(&e)).await.expect("memory");
        let r = red.report(std::slice::from_ref(&e)).await.expect("redis");
        assert_eq!(m, r, "after {e:?}");
    }
    // One call with entries of different subscribers (the bucket ids of
    // one stream): each entry is recorded under its own id.
    clock.advance(Duration::from_millis(10));
    let two = [entry("e", 1, 2_000, held), entry("f", 1, 3_000, held)];
    let m = mem.report(&two).await.expect("memory");
    let r = red.report(&two).await.expect("redis");
    assert_eq!(m, r, "two subscribers in one call");
    let ids: Vec<_> = m[1].subscribers.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, vec!["c", "d", "e", "f"]);
    // e and f leave (live_ms 0): their records alone go.
    let leave = |sub: &str| QuotaReport {
        live_ms: 0,
        held: None,
        ..entry(sub, 0, 0, None)
    };
    let two = [leave("e"), leave("f")];
    let m = mem.report(&two).await.expect("memory");
    let r = red.report(&two).await.expect("redis");
    assert_eq!(m, r, "two subscribers leave");
    assert!(m.iter().all(|v| v.subscribers.is_empty()), "{m:?}");
    let e = entry("c", 0, 1, held);
    let m = mem.report(std::slice::from_ref(&e)).await.expect("memory");
    let r = red.report(std::slice::from_ref(&e)).await.expect("redis");
    assert_eq!(m, r, "after the leave");
    let view = &m[0];
    let held: Vec<_> = view
        .subscribers
        .iter()
        .map(|s| (s.id.as_str(), s.held))
        .collect();
    assert_eq!(
        held,
        vec![
            (
                "c",
                Some(Held {
                    tokens_per_fill: 1,
                    max_tokens: 1
                })
            ),
            (
                "d",
                Some(Held {
                    tokens_per_fill: 9,
                    max_tokens: 10
                })
            ),
        ]
    );
}

/// A backend that holds the first recording call (a report charging
/// nothing) until told to go on.
#[derive(Debug)]
struct Gated {
    inner: Arc<dyn Storage>,
    gate: std::sync::Mutex<
        Option<(
            tokio::sync::oneshot::Sender<()>,
            tokio::sync::oneshot::Receiver<()>,
        )>,
    >,
}

#[async_trait::async_trait]
impl Storage for Gated {
    async fn apply(
        &self,
        charges: &[bucket_rls::storage::Charge],
    ) -> Result<bucket_rls::storage::RequestResult, bucket_rls::storage::StorageError> {
        self.inner.apply(charges).await
    }

    async fn ping(&self) -> Result<(), bucket_rls::storage::StorageError> {
        self.inner.ping().await
    }

    async fn report(
        &self,
        reports: &[bucket_rls::storage::quota::QuotaReport],
    ) -> Result<Vec<bucket_rls::storage::quota::QuotaView>, bucket_rls::storage::StorageError> {
        if reports.iter().all(|r| r.charge.cost == 0) {
            let gate = self.gate.lock().unwrap().take();
            if let Some((reached, go)) = gate {
                let _ = reached.send(());
                let _ = go.await;
            }
        }
        self.inner.report(reports).await
    }

    fn supports_quota(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        "gated"
    }
}

/// Two replicas on one Redis whose reports interleave between the read of
/// the records and the recording of the new assignment: replica A reads
/// alone (and computes the whole rule), replica B reports in full
/// meanwhile, then A records. The quota script cuts A's assignment to what
/// B left: what is sent, and what the hash holds, fit the rule (100/s).
/// The quota script charges a window rule's allowed counts as the memory
/// backend does (fixed and sliding windows, past the limit too, across
/// window edges): the same balance after every report.
#[tokio::test]
async fn quota_script_counts_windows_as_the_memory_backend() {
    use bucket_rls::storage::clock::ManualClock;
    use bucket_rls::storage::quota::{Held, QuotaReport};
    use bucket_rls::storage::{ChargeKind, ChargeSpec, Limit, WindowLimit};
    let redis = RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let mem = MemoryStorage::new(Arc::new(clock.clone()));
    let red = RedisStorage::builder(redis.url())
        .timeout(Duration::from_secs(2))
        .test_clock(Arc::new(clock.clone()))
        .build()
        .expect("valid URL");
    let window = WindowLimit::counting(10, std::num::NonZeroU64::new(60).expect("a minute"));
    for (name, limit) in [
        ("fixed", Limit::FixedWindow(window)),
        ("sliding", Limit::SlidingWindow(window)),
    ] {
        let entry = |cost: u64| QuotaReport {
            bucket: format!("t:d1:e|k1:k=v1:{name}"),
            subscribers: format!("t:qd1:e|k1:k=v1:{name}"),
            charge: ChargeSpec {
                limit,
                cost,
                kind: ChargeKind::Consume,
                shadow: false,
            },
            subscriber: "a".into(),
            demand_milli: 1_000,
            held: None,
            budget: Held {
                tokens_per_fill: 10,
                max_tokens: 10,
            },
            live_ms: 15_000,
        };
        let mut balances = Vec::new();
        for (advance_ms, cost) in [(0, 4), (1_000, 8), (5_000, 0), (30_000, 3), (45_000, 1)] {
            clock.advance(Duration::from_millis(advance_ms));
            let e = entry(cost);
            let m = mem.report(std::slice::from_ref(&e)).await.expect("memory");
            let r = red.report(std::slice::from_ref(&e)).await.expect("redis");
            assert_eq!(m, r, "{name} after {e:?}");
            balances.push(m[0].balance_micro / 1_000_000);
        }
        // 4 then 8 counted (12 of 10: past the limit, as admitted).
        assert_eq!(&balances[..3], &[6, -2, -2], "{name}");
    }
}

#[tokio::test]
async fn interleaved_replicas_never_assign_above_the_budget() {
    use bucket_rls::limiter::quota::{Action as Assigned, Answer, Usage};
    let redis = RedisServer::start();
    let storage = || -> Arc<dyn Storage> {
        Arc::new(
            RedisStorage::builder(redis.url())
                .timeout(Duration::from_secs(2))
                .build()
                .expect("valid URL"),
        )
    };
    let (reached, reached_rx) = tokio::sync::oneshot::channel();
    let (go, go_rx) = tokio::sync::oneshot::channel();
    let gated = Arc::new(Gated {
        inner: storage(),
        gate: std::sync::Mutex::new(Some((reached, go_rx))),
    });
    let replica_a = limiter(gated, "q:", false);
    let replica_b = limiter(storage(), "q:", false);
    let mut a = replica_a.quota_stream("edge").expect("bound");
    let mut b = replica_b.quota_stream("edge").expect("bound");
    static ID: &[(&str, &str)] = &[("tenant", "acme")];
    let usage = Usage {
        bucket: ID,
        allowed: 10,
        denied: 0,
    };
    let task = tokio::spawn(async move {
        let got = a.report(&[usage]).await.expect("a");
        (a, got)
    });
    reached_rx.await.expect("a reaches its recording call");
    let gb = b.report(&[usage]).await.expect("b");
    go.send(()).expect("a waits");
    let (_a, ga) = task.await.expect("a answers");
    let tokens = |answers: &[bucket_rls::limiter::quota::BucketAnswer]| match answers[0].answer {
        Answer::Assign {
            action:
                Assigned::TokenBucket {
                    tokens_per_fill,
                    max_tokens,
                    ..
                },
            ..
        } => (tokens_per_fill, max_tokens),
        Answer::Assign {
            action: Assigned::DenyAll,
            ..
        } => (0, 0),
        other => panic!("not a limit: {other:?}"),
    };
    let ((ta, ma), (tb, mb)) = (tokens(&ga), tokens(&gb));
    assert!(tb > 0, "b got its part: {gb:?}");
    assert!(ta + tb <= 100 && ma + mb <= 100, "sent {ga:?} and {gb:?}");
    let records: std::collections::HashMap<Vec<u8>, Vec<u8>> =
        redis.query(redis::cmd("HGETALL").arg("q:qd4:edge|k6:tenant=v4:acme"));
    assert_eq!(records.len(), 2, "{records:?}");
    let sum = records.values().fold((0, 0), |(t, m), v| {
        let (_, held, _) = bucket_rls::storage::quota::unpack(v).expect("a record");
        let h = held.expect("held");
        (t + h.tokens_per_fill, m + h.max_tokens)
    });
    assert_eq!(sum, (ta + tb, ma + mb), "recorded is what was sent");
}

/// However a stream ends (here: the client closes it), its subscriber
/// record leaves Redis at once, not when it expires, and the Envoy still
/// reporting gets the whole rule at its next report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_stream_leaves_its_share_to_the_others_at_once() {
    let redis = RedisServer::start();
    let storage: Arc<dyn Storage> = Arc::new(
        RedisStorage::builder(redis.url())
            .timeout(Duration::from_secs(2))
            .build()
            .expect("valid URL"),
    );
    let server = serve(limiter(storage, "q:", false)).await;
    let mut a = open(server.grpc).await;
    let mut b = open(server.grpc).await;
    let acme: &[(&str, &str)] = &[("tenant", "acme")];
    let records = "q:qd4:edge|k6:tenant=v4:acme";
    let mut last_b = (0, 0);
    for _ in 0..3 {
        a.send(report("edge", &[(acme, 40, 0)]))
            .await
            .expect("answer");
        let r = b
            .send(report("edge", &[(acme, 40, 0)]))
            .await
            .expect("answer");
        last_b = bucket(&r, 0).map_or((0, 0), |(m, t, _, _)| (m, t));
    }
    assert!(last_b.0 < 100 && last_b.1 < 100, "b shares: {last_b:?}");
    let fields: u64 = redis.query(redis::cmd("HLEN").arg(records));
    assert_eq!(fields, 2);
    drop(a);
    // The records live 15 s after a report; the leave comes well before.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let fields: u64 = redis.query(redis::cmd("HLEN").arg(records));
        if fields == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the ended stream's record is still there"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = b
        .send(report("edge", &[(acme, 40, 0)]))
        .await
        .expect("answer");
    assert_eq!(bucket(&r, 0), Ok((100, 100, 1, 15)));
}
