//! The conformance suite against the Redis Cluster backend: one six-node
//! cluster (three masters, three replicas) shared by every case of this
//! binary (each case has its own key prefix), with the test-only explicit
//! clock. A request's buckets land in different slots, so every multi-
//! descriptor case also checks that the reservation and refund scheme gives
//! exactly the single-node statuses.

mod common;

use async_trait::async_trait;
use bucket_rls::storage::Storage;
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::redis::cluster::RedisClusterStorage;
use common::cluster::RedisCluster;
use common::conformance::Backend;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The cluster of this test binary (its processes die with the binary).
fn shared() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::start)
}

struct ClusterBackend {
    cluster: &'static RedisCluster,
}

#[async_trait]
impl Backend for ClusterBackend {
    fn atomic_across_keys(&self) -> bool {
        false
    }

    async fn storage(&self, clock: ManualClock) -> Arc<dyn Storage> {
        // A generous timeout: these cases test answers, not latency.
        let s = RedisClusterStorage::builder(self.cluster.seeds())
            .timeout(Duration::from_secs(2))
            .test_clock(Arc::new(clock))
            .build()
            .expect("valid seeds");
        common::cluster::connected(&s).await;
        Arc::new(s)
    }
}

async fn cluster() -> ClusterBackend {
    let cluster = tokio::task::spawn_blocking(shared)
        .await
        .expect("start the cluster");
    ClusterBackend { cluster }
}

conformance_tests!(cluster);
