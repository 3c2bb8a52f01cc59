//! The conformance suite against the embedded memory backend.

mod common;

async fn memory() -> common::conformance::MemoryBackend {
    common::conformance::MemoryBackend
}

conformance_tests!(memory);
