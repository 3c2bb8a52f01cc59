//! The config in force ([`ConfigHandle`]) and the one way a config is
//! applied to it ([`ConfigHandle::apply`]): every source (the startup load,
//! the file watcher, xDS) hands its compiled config, or why it did not
//! compile, to `apply`, which swaps, runs the on-swap hook, counts the load,
//! sets the last-reload gauges, keeps or clears the last error, and logs.

use super::Config;
use crate::metrics as m;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

/// The last reload that failed, kept for `/rlconfig` until a reload succeeds
/// or the source returns to the config in force.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReloadError {
    /// When the failing state was first seen.
    pub at: SystemTime,
    /// Every problem, one per line (`file:line: path: message`).
    pub message: String,
}

/// The config in force, swapped atomically on reload, and the last failed
/// reload. Owned by config: a source writes it through [`Self::apply`], the
/// request path reads it without locking, the admin API shows both.
#[derive(Debug)]
pub struct ConfigHandle {
    current: ArcSwap<Config>,
    last_error: Mutex<Option<ReloadError>>,
    /// No config has been swapped in yet (a source that starts empty).
    awaiting_first: AtomicBool,
    source: Mutex<SourceStatus>,
}

/// Where the config in force comes from and how its source is doing, for
/// `/rlconfig` and `/metrics`. Each source fills what applies to it; the
/// optional fields stay `None` (and out of `/rlconfig`) for a source without
/// that notion (the file watcher has no connection, no version, no push).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceStatus {
    /// The source's kind: `file` or `xds` (empty when no source was named).
    pub kind: &'static str,
    /// Where it reads from: the path, or the server's address.
    pub location: String,
    /// For a source that keeps a connection to a server: whether it is open.
    pub connected: Option<bool>,
    /// For a source that labels its configs (xDS `version_info`): the label
    /// of the config in force.
    pub version: Option<String>,
    /// For a source that receives configs (a push): the last one received
    /// and what was done with it.
    pub last_push: Option<PushStatus>,
}

/// One config a source received (a push) and its outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushStatus {
    /// When it was received.
    pub at: SystemTime,
    /// Its version label (cut to a bounded length).
    pub version: String,
    /// The source's id of this delivery, such as an xDS nonce (cut to a
    /// bounded length).
    pub nonce: String,
    /// Accepted (applied, or equal to the config in force; an xDS ACK) or
    /// refused (an xDS NACK).
    pub accepted: bool,
    /// Why it was refused.
    pub error: Option<String>,
}

impl ConfigHandle {
    /// A handle whose config in force is `config`, with no reload error.
    #[must_use]
    pub fn new(config: Config) -> Self {
        Self {
            current: ArcSwap::from_pointee(config),
            last_error: Mutex::new(None),
            awaiting_first: AtomicBool::new(false),
            source: Mutex::new(SourceStatus::default()),
        }
    }

    /// A handle with no config yet (a source that delivers it later, such
    /// as xDS): [`Self::is_awaiting_first_config`] is true until the first
    /// [`Self::swap`]; the config in force meanwhile is [`Config::empty`].
    #[must_use]
    pub fn awaiting_first_config() -> Self {
        let h = Self::new(Config::empty());
        h.awaiting_first.store(true, Ordering::Release);
        h
    }

    /// Whether no config has been swapped in yet into a handle made by
    /// [`Self::awaiting_first_config`] (the request path then answers an
    /// error).
    #[must_use]
    pub fn is_awaiting_first_config(&self) -> bool {
        self.awaiting_first.load(Ordering::Acquire)
    }

    /// The source's status.
    #[must_use]
    pub fn source_status(&self) -> SourceStatus {
        self.source.lock().clone()
    }

    /// Updates the source's status.
    pub fn update_source_status(&self, f: impl FnOnce(&mut SourceStatus)) {
        f(&mut self.source.lock());
    }

    /// The config in force, for one request: a cheap guard, no reference
    /// count taken (hold it only for the request).
    #[must_use]
    pub fn load(&self) -> arc_swap::Guard<Arc<Config>> {
        self.current.load()
    }

    /// The config in force, as an owned reference.
    #[must_use]
    pub fn current(&self) -> Arc<Config> {
        self.current.load_full()
    }

    /// Swaps `config` in atomically and returns the config it replaced.
    /// Requests already running finish on the old one.
    pub fn swap(&self, config: Config) -> Arc<Config> {
        let old = self.current.swap(Arc::new(config));
        self.awaiting_first.store(false, Ordering::Release);
        old
    }

    /// The last failed reload, if the source has not loaded since.
    #[must_use]
    pub fn last_error(&self) -> Option<ReloadError> {
        self.last_error.lock().clone()
    }

    /// Records (or clears, with `None`) the last failed reload.
    pub fn set_last_error(&self, error: Option<ReloadError>) {
        *self.last_error.lock() = error;
    }
}

/// Called after a new config is swapped in, with the old and the new config
/// (the request path uses it to clear its local cache and to hold buckets a
/// slower rule would otherwise drop).
pub type OnSwap = Arc<dyn Fn(&Config, &Config) + Send + Sync>;

/// Where a config handed to [`ConfigHandle::apply`] comes from: it names the
/// config in the log lines.
#[derive(Clone, Copy, Debug)]
pub enum Origin<'a> {
    /// The config loaded before serving.
    Startup,
    /// A reload of the files at this path (file event, SIGHUP, rescan).
    Files(&'a Path),
    /// A push from an xDS management server, with its `version_info`
    /// (already cut to a bounded length).
    Xds {
        /// The response's `version_info`.
        version: &'a str,
    },
}

/// What [`ConfigHandle::apply`] (or a source's own checks before it) did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The config equals the config in force (same hash); nothing swapped.
    Unchanged,
    /// A new config was swapped in; its hash.
    Applied(String),
    /// The config does not load; the old one stays. Reported (logged,
    /// counted, kept as the last reload error).
    Failed,
    /// The same failing state as last time; not reported again (decided by
    /// the source, which knows what it read).
    FailedAgain,
}

impl ConfigHandle {
    /// Applies what a source produced: the only place a config is swapped
    /// in and the outcome recorded.
    ///
    /// - `Ok(config)` whose hash equals the config in force (and a first
    ///   config is not awaited): nothing is swapped; the source counts as
    ///   good (gauges at 1, last error cleared): [`Outcome::Unchanged`].
    /// - `Ok(config)` otherwise: swapped in, `on_swap` run with the old and
    ///   the new config, `config_load{result="success"}` counted, gauges
    ///   set, last error cleared, logged: [`Outcome::Applied`].
    /// - `Err(message)` (every problem, one per line): the config in force
    ///   stays, `config_load{result="error"}` counted, gauges set to failed,
    ///   the message kept as the last reload error, logged on one line:
    ///   [`Outcome::Failed`].
    pub fn apply(
        &self,
        result: Result<Config, String>,
        origin: Origin<'_>,
        on_swap: &OnSwap,
    ) -> Outcome {
        match result {
            Ok(config) => {
                let current = self.current();
                if !self.is_awaiting_first_config() && config.hash == current.hash {
                    if let Origin::Xds { version } = origin {
                        tracing::info!(version = %version, hash = %current.hash, "xDS push equals the config in force");
                    }
                    record_outcome(true);
                    self.set_last_error(None);
                    return Outcome::Unchanged;
                }
                let hash = config.hash.clone();
                log_applied(origin, &current, &config);
                let old = self.swap(config);
                on_swap(&old, &self.current());
                metrics::counter!(m::CONFIG_LOAD, "result" => "success").increment(1);
                record_outcome(true);
                self.set_last_error(None);
                Outcome::Applied(hash)
            }
            Err(message) => {
                metrics::counter!(m::CONFIG_LOAD, "result" => "error").increment(1);
                // One physical log line, also in the text format.
                let one_line = message.replace('\n', "; ");
                let kept = self.current().hash.clone();
                match origin {
                    Origin::Xds { version } => tracing::error!(
                        version = %version,
                        errors = %one_line,
                        kept = %kept,
                        "xDS config refused (NACK); keeping the config in force"
                    ),
                    Origin::Files(source) => tracing::error!(
                        source = %source.display(),
                        errors = %one_line,
                        kept = %kept,
                        "config reload failed; keeping the config in force"
                    ),
                    Origin::Startup => tracing::error!(
                        errors = %one_line,
                        "config does not load"
                    ),
                }
                self.set_last_error(Some(ReloadError {
                    at: SystemTime::now(),
                    message,
                }));
                record_outcome(false);
                Outcome::Failed
            }
        }
    }

    /// Records that a source which had failed is back to the config in
    /// force without a new config (the file watcher reading the files of
    /// the config in force again): the gauges at 1 (when `was_failing`) and
    /// the last error cleared.
    pub fn record_good_again(&self, was_failing: bool) {
        if was_failing {
            record_outcome(true);
        }
        self.set_last_error(None);
    }
}

/// Sets the last-reload gauges: whether the source loads, and when that was
/// last reported.
fn record_outcome(ok: bool) {
    metrics::gauge!(m::CONFIG_LAST_RELOAD_SUCCESSFUL).set(if ok { 1.0 } else { 0.0 });
    let now = SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    metrics::gauge!(m::CONFIG_LAST_RELOAD_TIMESTAMP).set(now);
}

/// At most this many rule changes are listed in a reload's log line.
const LOGGED_CHANGES: usize = 20;

/// The rule changes from `old` to `new` in `check-config --diff`'s words
/// (at most [`LOGGED_CHANGES`], then how many more), and its summary line.
fn rule_changes(old: &Config, new: &Config) -> (Vec<String>, String) {
    use super::diff;
    let changes = diff::diff(&diff::rules_of(old), &diff::rules_of(new));
    let summary = diff::summary(&changes);
    let mut lines: Vec<String> = changes
        .iter()
        .take(LOGGED_CHANGES)
        .map(|c| c.line.clone())
        .collect();
    if changes.len() > LOGGED_CHANGES {
        lines.push(format!("and {} more", changes.len() - LOGGED_CHANGES));
    }
    (lines, summary)
}

fn log_applied(origin: Origin<'_>, old: &Config, new: &Config) {
    match origin {
        Origin::Startup => {
            tracing::info!(domains = new.domains.len(), rules = new.rule_count(), hash = %new.hash, "config loaded");
        }
        Origin::Xds { version } => {
            let (changes, summary) = rule_changes(old, new);
            tracing::info!(
                version = %version,
                hash = %new.hash,
                previous = %old.hash,
                domains = new.domains.len(),
                rules = new.rule_count(),
                changes = ?changes,
                "xDS config applied: {summary}"
            );
        }
        Origin::Files(source) => {
            let mut added: Vec<&str> = new
                .domains
                .keys()
                .filter(|d| !old.domains.contains_key(*d))
                .map(String::as_str)
                .collect();
            let mut removed: Vec<&str> = old
                .domains
                .keys()
                .filter(|d| !new.domains.contains_key(*d))
                .map(String::as_str)
                .collect();
            added.sort_unstable();
            removed.sort_unstable();
            let (changes, summary) = rule_changes(old, new);
            tracing::info!(
                source = %source.display(),
                hash = %new.hash,
                previous = %old.hash,
                domains = new.domains.len(),
                rules = new.rule_count(),
                added_domains = ?added,
                removed_domains = ?removed,
                changes = ?changes,
                "config reloaded: {summary}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Origin, log_applied};
    use crate::config::compile::compile_texts;

    fn config(rpu: u32) -> crate::config::Config {
        let yaml = format!(
            "domain: e\ndescriptors:\n  - key: user\n    rate_limit: {{unit: minute, requests_per_unit: {rpu}}}\n  - key: other\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
        );
        compile_texts(&[("e.yaml".into(), yaml.into_bytes())]).expect("loads")
    }

    #[test]
    fn a_reload_log_names_the_rules_that_changed_and_how() {
        let (old, new) = (config(10), config(5));
        let text = crate::test_log::logged(tracing::Level::INFO, || {
            log_applied(Origin::Files(std::path::Path::new("e.yaml")), &old, &new);
            log_applied(Origin::Xds { version: "v2" }, &old, &new);
        });
        assert_eq!(
            text.matches("1 rule changed: 1 tightened").count(),
            2,
            "{text}"
        );
        assert_eq!(text.matches("e.user: tightened").count(), 2, "{text}");
        assert!(
            !text.contains("e.other"),
            "an unchanged rule is not listed: {text}"
        );
    }
}
