//! The conformance suite against the Redis backend: one real `redis-server`
//! per case, with the test-only explicit clock (the paused `ManualClock` is
//! sent to the script as `now_us`).

mod common;

use common::conformance::RedisBackend;
use common::redis::RedisServer;

async fn redis() -> RedisBackend {
    RedisBackend {
        server: RedisServer::start(),
    }
}

conformance_tests!(redis);
