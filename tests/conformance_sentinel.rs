//! The conformance suite against the Sentinel backend: one setup (master,
//! replica, three Sentinels) shared by every case of this binary (each case
//! has its own key prefix), with the test-only explicit clock. The storage
//! finds the master through the Sentinels, so every case also checks that
//! the discovered connection answers exactly as a single node does.

mod common;

use async_trait::async_trait;
use bucket_rls::storage::Storage;
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::redis::sentinel::RedisSentinelStorage;
use common::conformance::Backend;
use common::sentinel::{MASTER_NAME, SentinelSetup};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The Sentinel setup of this test binary (its processes die with the binary).
fn shared() -> &'static SentinelSetup {
    static SETUP: OnceLock<SentinelSetup> = OnceLock::new();
    SETUP.get_or_init(SentinelSetup::start)
}

struct SentinelBackend {
    setup: &'static SentinelSetup,
}

#[async_trait]
impl Backend for SentinelBackend {
    async fn storage(&self, clock: ManualClock) -> Arc<dyn Storage> {
        // A generous timeout: these cases test answers, not latency.
        let s = RedisSentinelStorage::builder(self.setup.sentinel_addrs(), MASTER_NAME)
            .timeout(Duration::from_secs(2))
            .test_clock(Arc::new(clock))
            .build()
            .expect("valid Sentinels");
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.master_addr().is_none() {
            assert!(Instant::now() < deadline, "no master discovered");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Arc::new(s)
    }
}

async fn sentinel() -> SentinelBackend {
    let setup = tokio::task::spawn_blocking(shared)
        .await
        .expect("start the Sentinel setup");
    SentinelBackend { setup }
}

conformance_tests!(sentinel);
