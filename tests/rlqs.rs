//! Envoy's quota service (`StreamRateLimitQuotas`) in process: the service
//! served on loopback by `app::run`, a tonic client generated from Envoy's
//! protos sending usage reports and reading assignments, over the memory
//! backend, over a real Redis shared by two replicas, and over a real
//! six-node Redis Cluster (three masters) shared by the cluster cases of
//! this binary, where one report's buckets live on several masters.

mod common;

use bucket_rls::app::{self, Listeners};
use bucket_rls::limiter::Limiter;
use bucket_rls::settings::ServiceSettings;
use bucket_rls::storage::Storage;
use bucket_rls::storage::key::{KeyValue, encode};
use bucket_rls::storage::memory::MemoryStorage;
use bucket_rls::storage::quota::subscribers_key;
use bucket_rls::storage::redis::RedisStorage;
use bucket_rls::storage::redis::cluster::key_slot;
use common::cluster::{RedisCluster, value_in};
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
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::Streaming;

const YAML: &str = "
domain: edge
descriptors:
  - key: tenant
    rate_limit: { unit: second, requests_per_unit: 100 }
";

/// A smaller rule, for counting what both protocols admit on it.
const MIX_YAML: &str = "
domain: mix
descriptors:
  - key: user
    rate_limit: { unit: second, requests_per_unit: 20 }
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
    Arc::new(new_limiter(storage, prefix, deny_unmatched))
}

/// The limiter of [`limiter`], not shared yet (to give it a quota clock).
fn new_limiter(storage: Arc<dyn Storage>, prefix: &str, deny_unmatched: bool) -> Limiter {
    // The recorder first: a gauge raised before it exists and lowered after
    // would throw off the stream counts other tests of this binary read.
    bucket_rls::metrics::install();
    let settings = ServiceSettings {
        key_prefix: prefix.to_owned(),
        rlqs_deny_unmatched: deny_unmatched,
        ..ServiceSettings::default()
    };
    Limiter::new(
        common::config(&[("t.yaml", YAML), ("mix.yaml", MIX_YAML)]),
        storage,
        settings,
    )
}

/// The key of the subscriber records of `tenant`'s bucket in domain `edge`.
fn records_key(prefix: &str, tenant: &str) -> String {
    subscribers_key(prefix, &tenant_bucket(prefix, tenant))
}

/// The bucket key of `tenant` in domain `edge`.
fn tenant_bucket(prefix: &str, tenant: &str) -> String {
    encode(prefix, "edge", &[("tenant", KeyValue::Value(tenant))])
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

/// `(max_tokens, tokens_per_fill)` of the `i`-th assignment, `(0, 0)` for
/// deny-all.
fn held(r: &RateLimitQuotaResponse, i: usize) -> (u32, u32) {
    bucket(r, i).map_or((0, 0), |(m, t, _, _)| (m, t))
}

/// The service shuts down: the stream gets every assignment again with a
/// time to live of 0, then ends.
async fn expect_ttl_zero_then_end(s: &mut Stream) {
    let m = tokio::time::timeout(Duration::from_secs(10), s.rx.message())
        .await
        .expect("in time")
        .expect("ok")
        .expect("a last message");
    assert!(!m.bucket_action.is_empty(), "{m:?}");
    for a in &m.bucket_action {
        let ttl = match &a.bucket_action {
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
        let (m, ta) = held(&r, 0);
        ma = m;
        let r = b
            .send(report("edge", &[(acme, 10, 0)]))
            .await
            .expect("answer");
        let (m, tb) = held(&r, 0);
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
        expect_ttl_zero_then_end(s).await;
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
        let (m, ta) = held(&r, 0);
        ma = m;
        let r = b
            .send(report("edge", &[(acme, 10, 0)]))
            .await
            .expect("answer");
        let (m, tb) = held(&r, 0);
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
        .query(redis::cmd("HLEN").arg(records_key("q:", "acme")));
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
        subscribers: subscribers_key("t:", "t:d1:e|k1:k=v1:v"),
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
            subscribers: subscribers_key("t:", &format!("t:d1:e|k1:k=v1:{name}")),
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
        redis.query(redis::cmd("HGETALL").arg(records_key("q:", "acme")));
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
    let records = records_key("q:", "acme");
    ended_stream_leaves_its_share(storage, "q:", || {
        redis.query(redis::cmd("HLEN").arg(&records))
    })
    .await;
}

/// Two streams share `tenant=acme` under `prefix` on `storage`, then one
/// closes: `records()` (the number of subscriber records of the bucket)
/// drops to 1 well before the records would expire, and the other stream
/// gets the whole rule at its next report.
async fn ended_stream_leaves_its_share(
    storage: Arc<dyn Storage>,
    prefix: &str,
    records: impl Fn() -> u64,
) {
    let server = serve(limiter(storage, prefix, false)).await;
    let mut a = open(server.grpc).await;
    let mut b = open(server.grpc).await;
    let acme: &[(&str, &str)] = &[("tenant", "acme")];
    let mut last_b = (0, 0);
    for _ in 0..3 {
        a.send(report("edge", &[(acme, 40, 0)]))
            .await
            .expect("answer");
        let r = b
            .send(report("edge", &[(acme, 40, 0)]))
            .await
            .expect("answer");
        last_b = held(&r, 0);
    }
    assert!(last_b.0 < 100 && last_b.1 < 100, "b shares: {last_b:?}");
    assert_eq!(records(), 2);
    drop(a);
    // The records live 15 s after a report; the leave comes well before.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while records() != 1 {
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

// ---------------------------------------------------------------------------
// Redis Cluster: three masters; the buckets of one report on all of them.
// ---------------------------------------------------------------------------

/// The cluster of this binary's cluster cases (its processes die with the
/// binary); each case has its own key prefix.
async fn cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    tokio::task::spawn_blocking(|| CLUSTER.get_or_init(RedisCluster::start))
        .await
        .expect("start the cluster")
}

async fn cluster_storage(c: &RedisCluster) -> Arc<dyn Storage> {
    Arc::new(common::cluster::storage(c, Duration::from_secs(2)).await)
}

/// `per_master` tenants of domain `edge` for each master of `c` whose
/// buckets under `prefix` that master serves, every bucket in a slot of its
/// own.
fn tenants_on_every_master(c: &RedisCluster, prefix: &str, per_master: usize) -> Vec<String> {
    let mut slots = Vec::new();
    let mut out = Vec::new();
    let shards = c.shards();
    assert_eq!(shards.len(), 3, "three masters");
    for (i, shard) in shards.iter().enumerate() {
        for j in 0..per_master {
            let v = value_in(
                shard,
                prefix,
                "edge",
                "tenant",
                &format!("t{i}{j}-"),
                &slots,
            );
            slots.push(key_slot(&tenant_bucket(prefix, &v)));
            out.push(v);
        }
    }
    out
}

/// The tenant the `i`-th action of a response is for.
fn tenant_of(r: &RateLimitQuotaResponse, i: usize) -> &str {
    r.bucket_action[i]
        .bucket_id
        .as_ref()
        .and_then(|b| b.bucket.get("tenant"))
        .map_or("", String::as_str)
}

/// Subscriber records of `tenant`'s bucket, read on the master of its slot.
fn cluster_records(c: &RedisCluster, prefix: &str, tenant: &str) -> u64 {
    let key = records_key(prefix, tenant);
    c.query_on(&key, redis::cmd("HLEN").arg(&key))
}

/// Two replicas on one Redis Cluster, one stream each, report six tenants
/// whose buckets sit in six slots over the three masters, each in one
/// report message (one quota script call per slot). Every tenant's two
/// shares fit its rule (100 a fill; 100 held, plus the one token each
/// subscriber may hold beyond it), follow that tenant's demand (the busier
/// stream holds more, the other keeps a part), and come back in the
/// report's order; each bucket's subscriber records live in its slot (by
/// the server's own `CLUSTER KEYSLOT`); `/rlqs` and the metrics show the
/// subscribers. Then the first replica shuts down: its stream gets TTL-0
/// assignments, its records leave every master, and the other stream's
/// next report gets each whole rule it held the smaller part of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_replicas_share_buckets_on_every_master_by_demand() {
    let c = cluster().await;
    let prefix = common::unique_prefix("rlqs");
    let tenants = tenants_on_every_master(c, &prefix, 2);
    let n = tenants.len();
    let mut one = serve(limiter(cluster_storage(c).await, &prefix, false)).await;
    let two = serve(limiter(cluster_storage(c).await, &prefix, false)).await;
    let mut a = open(one.grpc).await;
    let mut b = open(two.grpc).await;
    let ids: Vec<[(&str, &str); 1]> = tenants.iter().map(|t| [("tenant", t.as_str())]).collect();
    // Even tenants: a is the busy one (45 a report against 5); odd: b.
    let entries = |a_side: bool| -> Vec<Entry<'_>> {
        ids.iter()
            .enumerate()
            .map(|(i, id)| (&id[..], if (i % 2 == 0) == a_side { 45 } else { 5 }, 0))
            .collect()
    };
    let (ea, eb) = (entries(true), entries(false));
    let (mut ha, mut hb) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        let ra = a.send(report("edge", &ea)).await.expect("answer");
        let rb = b.send(report("edge", &eb)).await.expect("answer");
        for r in [&ra, &rb] {
            let order: Vec<&str> = (0..n).map(|i| tenant_of(r, i)).collect();
            assert_eq!(order, tenants, "answers in the report's order");
        }
        ha = (0..n).map(|i| held(&ra, i)).collect();
        hb = (0..n).map(|i| held(&rb, i)).collect();
        for (i, t) in tenants.iter().enumerate() {
            let ((ma, ta), (mb, tb)) = (ha[i], hb[i]);
            assert!(
                ta + tb <= 100 && ma + mb <= 100 + 2,
                "tenant {t}: {ma}+{mb} held, {ta}+{tb} a fill"
            );
        }
    }
    for (i, t) in tenants.iter().enumerate() {
        let (busy, idle) = if i % 2 == 0 {
            (ha[i], hb[i])
        } else {
            (hb[i], ha[i])
        };
        assert!(
            busy.1 > idle.1 && idle.1 > 0,
            "tenant {t}: the busy stream holds {busy:?}, the other {idle:?}"
        );
        let (bucket_key, records) = (tenant_bucket(&prefix, t), records_key(&prefix, t));
        assert_eq!(c.keyslot(&records), c.keyslot(&bucket_key), "{records}");
        assert_eq!(cluster_records(c, &prefix, t), 2, "{records}");
    }

    // The admin view and the metrics, as on any backend.
    let body = common::http::request(one.http, "GET", "/rlqs", None)
        .await
        .body;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    let label = format!("tenant={}", tenants[0]);
    let view = &v["streams"][0]["buckets"][label.as_str()];
    assert_eq!(
        view["subscribers"].as_array().map(Vec::len),
        Some(2),
        "{body}"
    );
    assert!(view["balance"].is_number(), "{body}");
    let metrics = common::http::request(one.http, "GET", "/metrics", None)
        .await
        .body;
    assert!(
        common::metrics::metric(
            &metrics,
            "bucket_rls_rlqs_subscribers",
            &[("rule", "edge.tenant")]
        )
        .is_some(),
        "{metrics}"
    );

    // The first replica shuts down: TTL 0, and its records leave.
    drop(one.stop.take());
    expect_ttl_zero_then_end(&mut a).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while tenants.iter().any(|t| cluster_records(c, &prefix, t) != 1) {
        assert!(
            std::time::Instant::now() < deadline,
            "the records of the replica shut down are still there"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rb = b.send(report("edge", &eb)).await.expect("answer");
    for (i, t) in tenants.iter().enumerate() {
        if i % 2 == 0 {
            assert_eq!(held(&rb, i), (100, 100), "tenant {t}: {rb:?}");
        }
    }
}

/// However a stream ends, on a Cluster too its subscriber record leaves
/// the master of its bucket's slot at once, and the other stream gets the
/// whole rule at its next report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_an_ended_stream_leaves_its_share_to_the_others_at_once() {
    let c = cluster().await;
    let prefix = common::unique_prefix("rlqs-end");
    ended_stream_leaves_its_share(cluster_storage(c).await, &prefix, || {
        cluster_records(c, &prefix, "acme")
    })
    .await;
}

/// A bucket abandoned (reported idle for 15 s on the service's clock)
/// leaves its subscriber record in the same report's call, on every master
/// the report's buckets live on, and the other subscriber then gets the
/// whole rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_abandoned_buckets_leave_their_records_on_every_master() {
    use bucket_rls::limiter::quota::{Action as Assigned, Answer, Usage};
    use bucket_rls::storage::clock::ManualClock;
    let c = cluster().await;
    let prefix = common::unique_prefix("rlqs-abandon");
    let tenants = tenants_on_every_master(c, &prefix, 1);
    let clock = ManualClock::new(1_000_000_000);
    let mut streams = Vec::new();
    for _ in 0..2 {
        let l = new_limiter(cluster_storage(c).await, &prefix, false)
            .with_quota_clock(Arc::new(clock.clone()));
        streams.push(Arc::new(l).quota_stream("edge").expect("bound"));
    }
    let ids: Vec<[(&str, &str); 1]> = tenants.iter().map(|t| [("tenant", t.as_str())]).collect();
    let usages = |allowed: u64| -> Vec<Usage<'_>> {
        ids.iter()
            .map(|id| Usage {
                bucket: &id[..],
                allowed,
                denied: 0,
            })
            .collect()
    };
    for s in &mut streams {
        s.report(&usages(10)).await.expect("answered");
    }
    for t in &tenants {
        assert_eq!(cluster_records(c, &prefix, t), 2, "{t}");
    }
    clock.advance(Duration::from_secs(16));
    streams[1].report(&usages(10)).await.expect("answered");
    let got = streams[0].report(&usages(0)).await.expect("answered");
    assert!(
        got.iter().all(|a| matches!(a.answer, Answer::Abandon)),
        "{got:?}"
    );
    for t in &tenants {
        assert_eq!(cluster_records(c, &prefix, t), 1, "{t}");
    }
    let got = streams[1].report(&usages(10)).await.expect("answered");
    for a in &got {
        assert!(
            matches!(
                a.answer,
                Answer::Assign {
                    action: Assigned::TokenBucket {
                        max_tokens: 100,
                        tokens_per_fill: 100,
                        ..
                    },
                    ..
                }
            ),
            "{got:?}"
        );
    }
}

/// An Envoy's quota bucket as Envoy 1.40 keeps it (examples/envoy/README.md,
/// "What Envoy 1.40's client does"): a new assignment starts full, a
/// changed one keeps the fill ratio (rounded down), and `tokens_per_fill`
/// are added every fill interval, up to `max_tokens`; deny-all holds
/// nothing.
#[derive(Debug)]
struct EnvoyBucket {
    max: u32,
    per_fill: u32,
    fill: Duration,
    tokens: u32,
    filled: tokio::time::Instant,
}

impl EnvoyBucket {
    /// The bucket of the `i`-th assignment of `r`, new.
    fn new(r: &RateLimitQuotaResponse, i: usize) -> Self {
        let mut b = Self {
            max: 0,
            per_fill: 0,
            fill: Duration::from_secs(1),
            tokens: 0,
            filled: tokio::time::Instant::now(),
        };
        b.assign(r, i);
        b.tokens = b.max;
        b
    }

    /// The `i`-th assignment of `r`, replacing the current one.
    fn assign(&mut self, r: &RateLimitQuotaResponse, i: usize) {
        self.refill();
        let (max, per_fill, fill) = match bucket(r, i) {
            Ok((m, t, f, _)) => (m, t, Duration::from_secs(f.unsigned_abs())),
            Err(_) => (0, 0, self.fill),
        };
        if max != self.max {
            self.tokens = if self.max == 0 {
                0
            } else {
                u32::try_from(u64::from(self.tokens) * u64::from(max) / u64::from(self.max))
                    .expect("fits")
            };
        }
        (self.max, self.per_fill, self.fill) = (max, per_fill, fill);
    }

    fn refill(&mut self) {
        let now = tokio::time::Instant::now();
        let fills = (now - self.filled).as_nanos() / self.fill.as_nanos().max(1);
        let fills = u32::try_from(fills).unwrap_or(u32::MAX);
        self.filled += self.fill * fills;
        self.tokens = self.max.min(
            self.tokens
                .saturating_add(self.per_fill.saturating_mul(fills)),
        );
    }

    /// Admits up to `offered` requests now; how many.
    fn admit(&mut self, offered: u32) -> u32 {
        self.refill();
        let n = offered.min(self.tokens);
        self.tokens -= n;
        n
    }
}

/// On one rule (r = 20/s, C = 20), what ShouldRateLimit admits and what an
/// Envoy admits under its RLQS assignments together stay within the
/// rule's tokens plus the debt RLQS may take, C + r·T + C + 5 s·r
/// (docs/design.md, "One rule through two protocols"), on a Cluster: the
/// allowed counts are charged to the bucket ShouldRateLimit charges, in
/// its slot. Both sides are offered twice the rule for 8 s; were the
/// charges on another bucket, each side would admit about C + r·T, 360 in
/// all, above the bound (300 at T = 8 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_both_protocols_together_stay_within_the_rule() {
    const R: f64 = 20.0;
    const C: f64 = 20.0;
    const RUN: Duration = Duration::from_secs(8);
    let c = cluster().await;
    let prefix = common::unique_prefix("rlqs-mix");
    let server = serve(limiter(cluster_storage(c).await, &prefix, false)).await;
    let mut envoy = open(server.grpc).await;
    let id: &[(&str, &str)] = &[("user", "u1")];
    let start = tokio::time::Instant::now();
    let grpc = server.grpc;
    let callers = tokio::spawn(async move {
        let mut client = RateLimitServiceClient::connect(format!("http://{grpc}"))
            .await
            .expect("connect");
        let mut admitted = 0u32;
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / (2.0 * R)));
        while start.elapsed() < RUN {
            tick.tick().await;
            let r = client
                .should_rate_limit(common::req("mix", vec![common::desc(&[("user", "u1")])], 1))
                .await
                .expect("answer")
                .into_inner();
            if r.overall_code == Code::Ok as i32 {
                admitted += 1;
            }
        }
        admitted
    });
    // The Envoy reports once a second what its bucket admitted of the 2r
    // offered in that second (Envoy reports every 5 s; the service times
    // demand on its own clock, so the period does not matter here).
    let r = envoy
        .send(report("mix", &[(id, 0, 0)]))
        .await
        .expect("answer");
    let mut quota = EnvoyBucket::new(&r, 0);
    let mut through_rlqs = 0u32;
    let offered = 2 * R as u32;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while start.elapsed() < RUN {
        tick.tick().await;
        let allowed = quota.admit(offered);
        through_rlqs += allowed;
        let r = envoy
            .send(report(
                "mix",
                &[(id, u64::from(allowed), u64::from(offered - allowed))],
            ))
            .await
            .expect("answer");
        quota.assign(&r, 0);
    }
    let through_rls = callers.await.expect("callers");
    let t = start.elapsed().as_secs_f64();
    let total = f64::from(through_rls + through_rlqs);
    let bound = C + R * t + C + 5.0 * R;
    eprintln!("in {t:.1} s: {through_rls} through ShouldRateLimit, {through_rlqs} through RLQS");
    assert!(
        total <= bound,
        "{through_rls} through ShouldRateLimit and {through_rlqs} through RLQS in {t:.1} s: {total} > C + r·T + C + 5 s·r = {bound}"
    );
    assert!(through_rlqs >= 20, "the Envoy was served: {through_rlqs}");
}
