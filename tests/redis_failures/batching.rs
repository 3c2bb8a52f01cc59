//! Many requests per script call: what queues behind the calls in flight,
//! what is ready when a call starts, and requests that give up or run out
//! of time while queued.

use super::*;

/// A backend through `proxy` with the local cache off, warmed up (connected,
/// script loaded), and its server's command statistics reset.
async fn warm_through(
    server: &RedisServer,
    proxy: &FaultProxy,
    timeout_ms: u64,
) -> Arc<RedisStorage> {
    let s = Arc::new(
        RedisStorage::builder(proxy.url())
            .timeout(Duration::from_millis(timeout_ms))
            .local_cache_size(0)
            .build()
            .expect("valid URL"),
    );
    wait_ready(&s).await;
    s.apply(&[hourly("warm", 10)]).await.expect("warm-up call");
    let _: () = server.query(redis::cmd("CONFIG").arg("RESETSTAT"));
    s
}

/// Calls of one backend in flight at once.
const IN_FLIGHT: usize = bucket_rls::storage::redis::MAX_IN_FLIGHT;

/// Requests that arrive while the script calls in flight fill the room go
/// together in the next call, and each is answered as if alone: of 62
/// requests on one bucket of 40 tokens, exactly 40 are admitted, each told a
/// different balance, in three script calls (the first two requests alone,
/// the 60 queued behind them together).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_behind_a_call_share_the_next_one() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port()).await;
    let s = warm_through(&server, &proxy, 5_000).await;
    proxy.delay_replies_ms(300);
    let apply =
        |s: Arc<RedisStorage>| tokio::spawn(async move { s.apply(&[hourly("hot", 40)]).await });
    // Calls in flight, each alone (their replies held 300 ms).
    let mut first = Vec::new();
    for _ in 0..IN_FLIGHT {
        first.push(apply(s.clone()));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let queued: Vec<_> = (0..60).map(|_| apply(s.clone())).collect();
    let mut left = Vec::new();
    for t in first.into_iter().chain(queued) {
        left.push(t.await.expect("task").expect("answer"));
    }
    let mut admitted: Vec<i64> = left
        .iter()
        .filter(|r| r.admitted)
        .map(|r| r.charges[0].remaining_micro / 1_000_000)
        .collect();
    admitted.sort_unstable();
    assert_eq!(admitted, (0..40).collect::<Vec<i64>>());
    assert!(
        left.iter()
            .filter(|r| !r.admitted)
            .all(|r| r.charges[0].remaining_micro < 1_000_000),
        "{left:?}"
    );
    assert_eq!(server.script_calls(), IN_FLIGHT as u64 + 1);
}

/// With one call in flight, a lone request goes at once (the tests
/// above), but requests that arrive together wait for that call and go
/// together in the next one: fewer, larger calls when the node is busy.
/// (One thread: both requests are queued in the same poll, before the
/// batching task can look at the queue.)
#[tokio::test(flavor = "current_thread")]
async fn requests_that_arrive_together_wait_for_the_call_in_flight() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port()).await;
    let s = warm_through(&server, &proxy, 20_000).await;
    // Replies held long enough that the checks below run while the
    // first one is still held, even on a loaded machine.
    proxy.delay_replies_ms(1_000);
    let first = tokio::spawn({
        let s = s.clone();
        async move { s.apply(&[hourly("together", 40)]).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(server.script_calls(), 1, "the first call is sent");
    let pair = tokio::spawn({
        let s = s.clone();
        async move {
            let (ca, cb) = ([hourly("together", 40)], [hourly("together", 40)]);
            let (a, b) = futures::join!(s.apply(&ca), s.apply(&cb));
            [a.expect("answer"), b.expect("answer")]
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The first call's reply is still held: the pair waits for it.
    assert_eq!(server.script_calls(), 1);
    assert!(first.await.expect("task").expect("answer").admitted);
    let pair = pair.await.expect("task");
    let mut left: Vec<i64> = pair
        .iter()
        .map(|r| r.charges[0].remaining_micro / 1_000_000)
        .collect();
    left.sort_unstable();
    assert_eq!(left, vec![37, 38]);
    assert_eq!(server.script_calls(), 2, "the pair in one call");
}

/// A request that gives up while queued behind the calls in flight (its
/// caller went away) is never sent: only the calls in flight charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_while_queued_is_never_sent() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port()).await;
    let s = warm_through(&server, &proxy, 5_000).await;
    proxy.delay_replies_ms(300);
    let mut in_flight = Vec::new();
    for _ in 0..IN_FLIGHT {
        in_flight.push(tokio::spawn({
            let s = s.clone();
            async move { s.apply(&[hourly("gone", 10)]).await }
        }));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let queued = tokio::spawn({
        let s = s.clone();
        async move { s.apply(&[hourly("gone", 10)]).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    queued.abort();
    for t in in_flight {
        assert!(t.await.expect("task").expect("answer").admitted);
    }
    proxy.delay_replies_ms(0);
    // Whole tokens: the bucket refills a little meanwhile.
    let after = s.apply(&[hourly("gone", 10)]).await.expect("answer");
    let charged = IN_FLIGHT as i64 + 1;
    assert_eq!(after.charges[0].remaining_micro / 1_000_000, 10 - charged);
    assert_eq!(server.script_calls(), IN_FLIGHT as u64 + 1);
}

/// A request's timeout counts from its own arrival, not from the calls it
/// waits behind: queued 100 ms after calls that never return, it fails
/// with a timeout no earlier than its own timeout after it arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_times_out_from_its_own_arrival() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port()).await;
    let s = warm_through(&server, &proxy, 300).await;
    proxy.hold(true);
    let mut held = Vec::new();
    for _ in 0..IN_FLIGHT {
        held.push(tokio::spawn({
            let s = s.clone();
            async move { s.apply(&[hourly("held", 10)]).await }
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let arrived = Instant::now();
    let queued = s.apply(&[hourly("held", 10)]).await;
    let took = arrived.elapsed();
    assert!(
        matches!(queued, Err(bucket_rls::storage::StorageError::Timeout(_))),
        "{queued:?}"
    );
    assert!(took >= Duration::from_millis(300), "{took:?}");
    for t in held {
        assert!(matches!(
            t.await.expect("task"),
            Err(bucket_rls::storage::StorageError::Timeout(_))
        ));
    }
    proxy.hold(false);
}

/// The batching task, about to start a call, first lets the tasks that are
/// ready run (one yield to the scheduler, no timer): a request whose task
/// became ready while the first one was being queued goes in the same
/// call, so a busy service sends fewer, larger calls, and a lone request
/// is sent after one pass of the scheduler. (One thread: the second
/// request's task is spawned after the batching task was woken by the
/// first, so without the yield the first would go alone.)
#[tokio::test(flavor = "current_thread")]
async fn a_request_ready_when_a_call_starts_goes_in_it() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port()).await;
    let s = warm_through(&server, &proxy, 20_000).await;
    let c1 = [hourly("ready", 40)];
    // The first request is queued (waking the batching task) before the
    // second one's task is spawned.
    let (first, second) = futures::join!(s.apply(&c1), async {
        let s = s.clone();
        let task = tokio::spawn(async move { s.apply(&[hourly("ready", 40)]).await });
        task.await.expect("task")
    });
    let second = second.expect("answer");
    let mut left =
        [first.expect("answer"), second].map(|r| r.charges[0].remaining_micro / 1_000_000);
    left.sort_unstable();
    assert_eq!(left, [38, 39]);
    assert_eq!(server.script_calls(), 1, "both requests in one call");
}
