//! The conformance suite against the Redis backend: one real `redis-server`
//! per case, with the test-only explicit clock (the paused `ManualClock` is
//! sent to the script as `now_us`).

mod common;

use async_trait::async_trait;
use bucket_rls::storage::Storage;
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::redis::RedisStorage;
use common::conformance::Backend;
use common::redis::RedisServer;
use std::sync::Arc;
use std::time::Duration;

/// A Redis backend on its own server.
struct RedisBackend {
    server: RedisServer,
}

#[async_trait]
impl Backend for RedisBackend {
    async fn storage(&self, clock: ManualClock) -> Arc<dyn Storage> {
        // A generous timeout: these cases test answers, not latency.
        let s = RedisStorage::builder(self.server.url())
            .timeout(Duration::from_secs(2))
            .test_clock(Arc::new(clock))
            .build()
            .expect("valid URL");
        Arc::new(s)
    }
}

async fn redis() -> RedisBackend {
    RedisBackend {
        server: RedisServer::start(),
    }
}

conformance_tests!(redis);
