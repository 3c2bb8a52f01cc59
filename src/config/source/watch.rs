//! The file source: hot reload of a file or directory (docs/design.md, "Hot
//! reload"). File events, SIGHUP and a periodic rescan all lead to the same
//! [`Reloader::apply`], which reads and compiles the files completely and
//! hands the result to [`ConfigHandle::apply`] (swap, or keep the old config
//! and report), unless the files are the config in force.
//!
//! What is watched: for a file source its parent directory, for a directory
//! source the directory itself, non-recursively. That one watch sees every
//! update pattern: an in-place write (modify/close-write on the file),
//! write-then-rename (a rename into the directory), create and delete, and
//! the Kubernetes ConfigMap swap, which creates a new hidden `..<timestamp>`
//! directory and renames a new `..data` symlink over the old one (both are
//! entries of the watched directory, so the swap is seen although the files
//! themselves live one level down).
//!
//! Why the extra machinery around `notify`:
//! - **Settling.** An event may arrive while a writer is half-way through an
//!   in-place write. After an event the source is read until two reads
//!   [`WatchOptions::settle`] apart have the same hash; after an in-place
//!   write to a config file (or a rescan that found a change) it must stay
//!   unchanged for [`WatchOptions::stable`] (2 s). Only that state is
//!   compiled, so a writer that pauses mid-file for less than that is never
//!   applied half-written; one that pauses longer may be (a prefix of YAML is
//!   often valid YAML), which is why writers should write a temporary file
//!   and rename it into place: a rename is atomic and applies at once.
//! - **Exactly once.** The hash of the files read is compared with the hash of
//!   the config in force before compiling: duplicate events, our own reads and
//!   the periodic rescan never count a reload. A failing state is reported
//!   (logged, counted as `config_load{result="error"}`, kept as the last
//!   reload error) once, not on every rescan; SIGHUP reports it again.
//! - **Lost events.** inotify can overflow or miss a swap; every
//!   [`WatchOptions::rescan`] the source is read and compared by hash anyway.
//!
//! Reloads never touch buckets: bucket identity does not include the rate
//! (docs/design.md, "Reloads"), so tokens carry over, capped at the new capacity.

use crate::config::compile::{LoadOptions, compile_texts_with};
use crate::config::files::hash_files;
use crate::config::{ConfigError, ConfigErrors, ConfigHandle, OnSwap, Origin};
use notify_debouncer_full::notify::event::{AccessKind, AccessMode};
use notify_debouncer_full::notify::{EventKind, RecursiveMode};
use notify_debouncer_full::{DebounceEventResult, new_debouncer};
use parking_lot::Mutex;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Most settle rounds before the last state read is used anyway (a file that
/// changes without pause for this long is compiled as it is then).
const MAX_SETTLE_ROUNDS: u32 = 8;

/// Longest wait for an in-place write to become stable; a file rewritten
/// without a pause of [`WatchOptions::stable`] for this long is compiled as
/// it is then.
const MAX_STABLE_WAIT: Duration = Duration::from_secs(30);

/// Timings of the watcher.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WatchOptions {
    /// Quiet time the debouncer waits after a file event before reporting it.
    pub debounce: Duration,
    /// Time between the two reads that must agree before a state is compiled.
    pub settle: Duration,
    /// After an in-place write (a config file's data changed, rather than a
    /// file renamed into place), how long the source must stay unchanged
    /// before it is compiled: a writer that pauses mid-file for less than
    /// this is never applied half-written.
    pub stable: Duration,
    /// Period of the full rescan that covers lost file events.
    pub rescan: Duration,
    /// How the files become one config (merged domains or not).
    pub load: LoadOptions,
}

impl Default for WatchOptions {
    /// 200 ms debounce, 250 ms settle, 2 s stability after in-place writes,
    /// 10 s rescan: a rename (write-then-rename, a ConfigMap swap) applies
    /// within the 2 s reload target, an in-place write within about 2.5 s
    /// of its last byte.
    fn default() -> Self {
        Self {
            debounce: Duration::from_millis(200),
            settle: Duration::from_millis(250),
            stable: Duration::from_secs(2),
            rescan: Duration::from_secs(10),
            load: LoadOptions::default(),
        }
    }
}

pub use crate::config::{Outcome, ReloadError};

/// Files of one read of the source: `(name, bytes)`, names as
/// [`crate::config::files::load_source`] gives them, so hashes agree with it.
pub type Snapshot = Result<Vec<(String, Vec<u8>)>, ConfigErrors>;

pub use crate::config::files::read_source;

fn fingerprint(snap: &Snapshot) -> String {
    match snap {
        Ok(texts) => hash_files(texts),
        Err(e) => format!("unreadable: {e}"),
    }
}

/// Applies snapshots of one source to one [`ConfigHandle`], calling an
/// [`OnSwap`] hook after each swap. Synchronous and deterministic: the
/// watcher task calls it, tests may call it directly.
pub struct Reloader {
    source: PathBuf,
    handle: Arc<ConfigHandle>,
    on_swap: OnSwap,
    load: LoadOptions,
    /// Fingerprint of the last reported failing state.
    failed: Mutex<Option<String>>,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader")
            .field("source", &self.source)
            .field("handle", &self.handle)
            .finish_non_exhaustive()
    }
}

impl Reloader {
    /// A reloader of `source` into `handle`; `on_swap` runs after every swap.
    #[must_use]
    pub fn new(source: PathBuf, handle: Arc<ConfigHandle>, on_swap: OnSwap) -> Self {
        Self {
            source,
            handle,
            on_swap,
            load: LoadOptions::default(),
            failed: Mutex::new(None),
        }
    }

    /// This reloader compiling with `load` (merged domains or not).
    #[must_use]
    pub fn with_load_options(mut self, load: LoadOptions) -> Self {
        self.load = load;
        self
    }

    /// The watched source.
    #[must_use]
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Reads the source once and applies it (no settling).
    pub fn reload(&self, force: bool) -> Outcome {
        self.apply(read_source(&self.source), force)
    }

    /// Applies one snapshot: skips it when it equals the config in force,
    /// otherwise compiles it completely and hands it to
    /// [`ConfigHandle::apply`] (swap, or keep the old config and report the
    /// error). `force` (SIGHUP) reports a failing state again even if it was
    /// reported before.
    pub fn apply(&self, snap: Snapshot, force: bool) -> Outcome {
        let fp = fingerprint(&snap);
        let current = self.handle.current();
        if snap.is_ok() && fp == current.hash {
            let was_failing = self.failed.lock().take().is_some();
            if was_failing {
                tracing::info!(source = %self.source.display(), hash = %fp, "config source is good again: it is the config in force");
            }
            self.handle.record_good_again(was_failing);
            if force {
                tracing::info!(source = %self.source.display(), hash = %fp, "reload requested: config unchanged");
            }
            return Outcome::Unchanged;
        }
        if !force && self.failed.lock().as_deref() == Some(fp.as_str()) {
            return Outcome::FailedAgain;
        }
        let result = snap
            .and_then(|texts| compile_texts_with(&texts, self.load))
            .map_err(|errors| errors.to_string());
        let outcome = self
            .handle
            .apply(result, Origin::Files(&self.source), &self.on_swap);
        match &outcome {
            Outcome::Applied(hash) => {
                if self.failed.lock().take().is_some() {
                    tracing::info!(source = %self.source.display(), hash = %hash, "config source is good again after a failed reload");
                }
            }
            Outcome::Failed => *self.failed.lock() = Some(fp),
            Outcome::Unchanged | Outcome::FailedAgain => {}
        }
        outcome
    }
}

/// What woke the reload task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Trigger {
    /// File events (after debouncing); `in_place` when one of them changed
    /// a config file's data where it is (not a rename into place).
    Event {
        /// Needs [`WatchOptions::stable`] before compiling.
        in_place: bool,
    },
    /// SIGHUP or [`ConfigWatcher::reload_now`].
    Force,
}

/// Why file events are unavailable (logged; the rescan still runs).
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The file watcher could not be created or could not watch the path.
    #[error("cannot watch {path}: {source}")]
    Notify {
        /// The directory that was to be watched.
        path: String,
        /// What `notify` reported.
        #[source]
        source: notify_debouncer_full::notify::Error,
    },
}

type Debouncer = notify_debouncer_full::Debouncer<
    notify_debouncer_full::notify::RecommendedWatcher,
    notify_debouncer_full::RecommendedCache,
>;

/// A running watcher: file events, the periodic rescan and forced reloads,
/// all applied by one task in order. Stops when dropped.
#[derive(Debug)]
pub struct ConfigWatcher {
    triggers: mpsc::UnboundedSender<Trigger>,
    task: tokio::task::JoinHandle<()>,
    reloader: Arc<Reloader>,
    debouncer: Option<Debouncer>,
}

impl ConfigWatcher {
    /// Starts watching `source` and applying its changes to `handle`, calling
    /// `on_swap` after each swap. Must be called inside a Tokio runtime.
    ///
    /// When the directory cannot be watched (inotify limits reached, no
    /// permission), the error is logged and reloads still happen on
    /// [`Self::reload_now`] (SIGHUP) and every [`WatchOptions::rescan`]: a
    /// running service is not stopped because file events are unavailable.
    #[must_use]
    pub fn spawn(
        source: PathBuf,
        handle: Arc<ConfigHandle>,
        on_swap: OnSwap,
        options: WatchOptions,
    ) -> Self {
        let dir = watched_dir(&source);
        let (tx, rx) = mpsc::unbounded_channel();
        let debouncer = match watch_dir(&dir, options.debounce, tx.clone()) {
            Ok(d) => {
                tracing::info!(dir = %dir.display(), source = %source.display(), "watching config for changes");
                Some(d)
            }
            Err(e) => {
                tracing::error!(error = %e, rescan = ?options.rescan, "no file events for the config; changes apply on SIGHUP and at each rescan");
                None
            }
        };
        let reloader =
            Arc::new(Reloader::new(source, handle, on_swap).with_load_options(options.load));
        let task = tokio::spawn(run(reloader.clone(), rx, options));
        Self {
            triggers: tx,
            task,
            reloader,
            debouncer,
        }
    }

    /// Whether file events are being received (false when the directory
    /// could not be watched; the rescan still runs).
    #[must_use]
    pub fn is_watching(&self) -> bool {
        self.debouncer.is_some()
    }

    /// Asks for an immediate reload (what SIGHUP does): the source is read
    /// even without a file event, and a failing state is reported again.
    pub fn reload_now(&self) {
        let _ = self.triggers.send(Trigger::Force);
    }

    /// A cloneable handle that asks for reloads (for a SIGHUP task).
    #[must_use]
    pub fn reload_handle(&self) -> ReloadHandle {
        ReloadHandle(self.triggers.clone())
    }

    /// The reloader behind this watcher.
    #[must_use]
    pub fn reloader(&self) -> &Arc<Reloader> {
        &self.reloader
    }
}

/// Starts the file source for [`super::spawn`]: records where the config
/// comes from, applies `initial` (the config loaded from `path` before
/// serving; an empty config when `None`) as the startup load, and watches
/// `path` with the default timings.
pub(super) fn spawn_source(
    path: PathBuf,
    initial: Option<crate::config::Config>,
    handle: Arc<ConfigHandle>,
    on_swap: OnSwap,
    load: LoadOptions,
) -> super::SourceHandle {
    handle.update_source_status(|st| {
        st.kind = "file";
        st.location = path.display().to_string();
    });
    handle.apply(
        Ok(initial.unwrap_or_else(crate::config::Config::empty)),
        Origin::Startup,
        &on_swap,
    );
    let watcher = ConfigWatcher::spawn(
        path,
        handle,
        on_swap,
        WatchOptions {
            load,
            ..WatchOptions::default()
        },
    );
    let reload = watcher.reload_handle();
    // The config is in force from the start: the signal is true and stays so.
    let (first_tx, first) = tokio::sync::watch::channel(true);
    super::SourceHandle::new(
        Box::new((watcher, first_tx)),
        first,
        false,
        Some(Arc::new(move || reload.reload_now())),
    )
}

/// Asks a [`ConfigWatcher`] for immediate reloads; does nothing once the
/// watcher is gone.
#[derive(Clone, Debug)]
pub struct ReloadHandle(mpsc::UnboundedSender<Trigger>);

impl ReloadHandle {
    /// Same as [`ConfigWatcher::reload_now`].
    pub fn reload_now(&self) {
        let _ = self.0.send(Trigger::Force);
    }
}

impl Drop for ConfigWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Watches `dir` non-recursively; every debounced change sends a trigger.
fn watch_dir(
    dir: &Path,
    debounce: Duration,
    triggers: mpsc::UnboundedSender<Trigger>,
) -> Result<Debouncer, WatchError> {
    let notify_err = |e| WatchError::Notify {
        path: dir.display().to_string(),
        source: e,
    };
    let mut debouncer = new_debouncer(debounce, None, move |result: DebounceEventResult| {
        match result {
            Ok(evs) => {
                if evs.iter().any(|e| is_change(&e.event.kind)) {
                    // The debouncer reports write-then-rename as a create of
                    // the final name (and its writes under that name): a path
                    // created or renamed in this batch is a new file, put in
                    // place whole, not an in-place write.
                    let renamed: Vec<&PathBuf> = evs
                        .iter()
                        .filter(|e| {
                            matches!(
                                e.event.kind,
                                EventKind::Create(_)
                                    | EventKind::Modify(
                                        notify_debouncer_full::notify::event::ModifyKind::Name(_)
                                    )
                            )
                        })
                        .flat_map(|e| e.event.paths.iter())
                        .collect();
                    let in_place = evs
                        .iter()
                        .any(|e| is_in_place_write(&e.event, &renamed));
                    let _ = triggers.send(Trigger::Event { in_place });
                }
            }
            Err(errs) => {
                for e in errs {
                    tracing::warn!(error = %e, "config watcher error; the periodic rescan still applies changes");
                }
                let _ = triggers.send(Trigger::Event { in_place: true });
            }
        }
    })
    .map_err(notify_err)?;
    debouncer
        .watch(dir, RecursiveMode::NonRecursive)
        .map_err(notify_err)?;
    Ok(debouncer)
}

/// The directory to watch for `source`: a directory itself, or a file's parent.
fn watched_dir(source: &Path) -> PathBuf {
    if source.is_dir() {
        return source.to_path_buf();
    }
    match source.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Whether an event wrote data into a file the loader reads (a visible
/// `*.yaml`/`*.yml`) where it is: such a file may be half-written. A file
/// created or renamed into place (`renamed`: the paths the same batch
/// created or renamed; the debouncer reports write-then-rename as a create
/// of the final name), a delete, or writes to a temporary or hidden file (a
/// ConfigMap's `..data` swap) are not. So a new file written in place with a
/// pause gets only the short settle.
fn is_in_place_write(event: &notify_debouncer_full::notify::Event, renamed: &[&PathBuf]) -> bool {
    use notify_debouncer_full::notify::event::ModifyKind;
    let writes = matches!(
        event.kind,
        EventKind::Access(AccessKind::Close(AccessMode::Write))
            | EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any | ModifyKind::Other)
    );
    writes
        && event.paths.iter().any(|p| {
            if renamed.contains(&p) {
                return false;
            }
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml"))
        })
}

/// Whether an event may change what the loader reads. Opens and read-only
/// closes (our own reads among them) are not.
fn is_change(kind: &EventKind) -> bool {
    match kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    }
}

async fn read_async(source: PathBuf) -> Snapshot {
    tokio::task::spawn_blocking(move || read_source(&source))
        .await
        .unwrap_or_else(|e| {
            Err(ConfigErrors(vec![ConfigError {
                file: String::new(),
                line: None,
                path: String::new(),
                message: format!("reading the config source panicked: {e}"),
            }]))
        })
}

/// Reads the source until two reads `settle` apart agree (or the rounds run
/// out), so a file that is still being written is not compiled. With
/// `stable`, reads go on every `settle` until the source has not changed for
/// `stable` (at most [`MAX_STABLE_WAIT`]).
async fn settled(
    source: &Path,
    settle: Duration,
    stable: Option<Duration>,
    current: &str,
) -> Snapshot {
    let mut snap = read_async(source.to_path_buf()).await;
    let mut fp = fingerprint(&snap);
    if snap.is_ok() && fp == current && stable.is_none() {
        return snap;
    }
    if let Some(stable) = stable {
        let started = tokio::time::Instant::now();
        let mut unchanged_since = started;
        while unchanged_since.elapsed() < stable && started.elapsed() < MAX_STABLE_WAIT {
            tokio::time::sleep(settle).await;
            let next = read_async(source.to_path_buf()).await;
            let next_fp = fingerprint(&next);
            if next_fp != fp {
                unchanged_since = tokio::time::Instant::now();
            }
            snap = next;
            fp = next_fp;
        }
        return snap;
    }
    for _ in 0..MAX_SETTLE_ROUNDS {
        tokio::time::sleep(settle).await;
        let next = read_async(source.to_path_buf()).await;
        let next_fp = fingerprint(&next);
        if next_fp == fp {
            return next;
        }
        snap = next;
        fp = next_fp;
    }
    snap
}

async fn run(
    reloader: Arc<Reloader>,
    mut rx: mpsc::UnboundedReceiver<Trigger>,
    options: WatchOptions,
) {
    let mut rescan = tokio::time::interval(options.rescan);
    rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    rescan.tick().await;
    loop {
        // A rescan does not know how the files changed: it waits for
        // stability like an in-place write (only when something changed).
        let (mut force, mut in_place) = tokio::select! {
            t = rx.recv() => match t {
                Some(Trigger::Force) => (true, false),
                Some(Trigger::Event { in_place }) => (false, in_place),
                None => return,
            },
            _ = rescan.tick() => (false, true),
        };
        while let Ok(t) = rx.try_recv() {
            match t {
                Trigger::Force => force = true,
                Trigger::Event { in_place: i } => in_place |= i,
            }
        }
        let current = reloader.handle.current().hash.clone();
        // SIGHUP is the operator saying "the files are ready": no wait.
        let stable = (in_place && !force).then_some(options.stable);
        let stable = match stable {
            // Nothing changed: nothing to wait for.
            Some(_) if fingerprint(&read_async(reloader.source.clone()).await) == current => None,
            s => s,
        };
        let snap = settled(&reloader.source, options.settle, stable, &current).await;
        let r = reloader.clone();
        let _ = tokio::task::spawn_blocking(move || r.apply(snap, force)).await;
    }
}
