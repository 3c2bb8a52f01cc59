//! Config sources, side by side: [`watch`] (a file or directory, reloaded
//! on change) and [`xds`] (a control plane pushes the config).
//!
//! The contract every source keeps (as the Go service's config providers
//! do: they deliver configs, one receiver applies them):
//! - it is started by one function taking the [`ConfigHandle`] to write and
//!   the [`OnSwap`] hook, and returns a [`SourceHandle`];
//! - it hands each compiled config, or the reason it did not compile, to
//!   [`ConfigHandle::apply`], the only place a config is swapped in and the
//!   outcome counted and recorded; what a source does itself is only what
//!   belongs to it (reading and settling files, the xDS stream, ACK/NACK);
//! - it fills the parts of [`crate::config::SourceStatus`] that apply to it;
//! - it stops when its [`SourceHandle`] is dropped; the config in force stays.
//!
//! Neither source imports the other. [`spawn`] picks the source the settings
//! name, so the service starts any of them with one call.

pub mod watch;
pub mod xds;

use crate::config::compile::LoadOptions;
use crate::config::{Config, ConfigHandle, OnSwap};
use crate::settings::ConfigSource;
use std::sync::Arc;
use tokio::sync::watch as signal;

/// Asks a source for an immediate reload (SIGHUP); a clone per task.
pub type Reload = Arc<dyn Fn() + Send + Sync>;

/// A running config source. Dropping it stops the source (the config in
/// force stays).
pub struct SourceHandle {
    /// Held for its `Drop`, which stops the source's task.
    running: Box<dyn std::fmt::Debug + Send + Sync>,
    first: signal::Receiver<bool>,
    wait_for_first: bool,
    reload: Option<Reload>,
}

impl std::fmt::Debug for SourceHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceHandle")
            .field("running", &self.running)
            .field("has_first_config", &self.has_first_config())
            .field("wait_for_first", &self.wait_for_first)
            .field("reload", &self.reload.is_some())
            .finish()
    }
}

impl SourceHandle {
    /// A handle on a running source: `running` stops it when dropped,
    /// `first` turns true once a first config is in force, the service
    /// binds its ports only after that when `wait_for_first`, and `reload`
    /// (if the source can re-read on demand) is what SIGHUP calls.
    #[must_use]
    pub fn new(
        running: Box<dyn std::fmt::Debug + Send + Sync>,
        first: signal::Receiver<bool>,
        wait_for_first: bool,
        reload: Option<Reload>,
    ) -> Self {
        Self {
            running,
            first,
            wait_for_first,
            reload,
        }
    }

    /// Whether a first config is in force already.
    #[must_use]
    pub fn has_first_config(&self) -> bool {
        *self.first.borrow()
    }

    /// Resolves once a first config is in force (at once if one is).
    pub async fn first_config(&self) {
        self.first_config_signal().await;
    }

    /// [`Self::first_config`] as a future not tied to the handle's lifetime
    /// (for a task that waits for it).
    pub fn first_config_signal(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.first.clone();
        async move {
            let _ = rx.wait_for(|got| *got).await;
        }
    }

    /// Whether the service should bind its ports only once
    /// [`Self::first_config`] resolves.
    #[must_use]
    pub fn waits_for_first_config(&self) -> bool {
        self.wait_for_first
    }

    /// What SIGHUP calls to reload now; `None` for a source with nothing to
    /// re-read (xDS).
    #[must_use]
    pub fn reload(&self) -> Option<Reload> {
        self.reload.clone()
    }
}

/// Starts the source `source` names, writing into `handle` and calling
/// `on_swap` after each swap; configs are compiled with `load`. `initial`
/// is a config already loaded from a file source (applied at once, as the
/// startup load); other sources ignore it. Must be called inside a Tokio
/// runtime.
#[must_use]
pub fn spawn(
    source: ConfigSource,
    initial: Option<Config>,
    handle: Arc<ConfigHandle>,
    on_swap: OnSwap,
    load: LoadOptions,
) -> SourceHandle {
    match source {
        ConfigSource::File(path) => watch::spawn_source(path, initial, handle, on_swap, load),
        ConfigSource::Xds(settings) => xds::spawn(*settings, handle, on_swap, load).into(),
    }
}
