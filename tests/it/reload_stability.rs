//! A config written in place with a pause mid-file is not applied while it is
//! half-written, as long as the pause is shorter than the stability window.

use crate::common::eventually::eventually;
use bucket_rls::config::files;
use bucket_rls::config::source::watch::{ConfigWatcher, WatchOptions};
use bucket_rls::limiter::Limiter;
use bucket_rls::settings::ServiceSettings;
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::memory::MemoryStorage;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

/// The attack: `requests_per_unit: 1000` written in place, cut after `1`
/// for 1.5 s. The prefix is a valid config (1 per minute for everyone);
/// before, two reads 250 ms apart agreed during the pause and it was applied
/// for the rest of the pause. Now an in-place write must stay unchanged for
/// 2 s, so only the whole file is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_paused_mid_write_is_not_applied_half_written() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rl.yaml");
    let head = "domain: st\ndescriptors:\n  - key: user\n    rate_limit:\n      unit: minute\n      requests_per_unit: 1";
    std::fs::write(&file, format!("{head}0\n")).unwrap();
    let config = files::load_source(dir.path()).unwrap();
    let storage = Arc::new(MemoryStorage::new(Arc::new(ManualClock::new(1_000_000))));
    let limiter = Arc::new(Limiter::new(config, storage, ServiceSettings::default()));
    let watcher = ConfigWatcher::spawn(
        dir.path().to_path_buf(),
        limiter.config_handle().clone(),
        limiter.on_swap(),
        WatchOptions::default(),
    );
    assert!(watcher.is_watching());
    let rate = |l: &Limiter| match &l.config().domains["st"].rules[0].policy {
        bucket_rls::config::Policy::Limited {
            requests_per_unit, ..
        } => *requests_per_unit,
        bucket_rls::config::Policy::Unlimited => panic!("limited"),
    };
    assert_eq!(rate(&limiter), 10);
    let seen = Arc::new(parking_lot::Mutex::new(std::collections::BTreeSet::new()));
    let sampler = {
        let (limiter, seen) = (limiter.clone(), seen.clone());
        tokio::spawn(async move {
            loop {
                seen.lock().insert(rate(&limiter));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&file)
            .unwrap();
        f.write_all(format!("{head}\n").as_bytes()).unwrap();
        f.flush().unwrap();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        f.set_len(0).unwrap();
        use std::io::Seek;
        f.seek(std::io::SeekFrom::Start(0)).unwrap();
        f.write_all(format!("{head}000\n").as_bytes()).unwrap();
    }
    eventually(
        Duration::from_secs(15),
        "the whole file applied",
        || async { (rate(&limiter) == 1000).then_some(()) },
    )
    .await;
    sampler.abort();
    let seen = seen.lock().clone();
    assert!(
        !seen.contains(&1),
        "the half-written file (1 per minute) was applied: {seen:?}"
    );
}
