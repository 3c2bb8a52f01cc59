//! Test helper (unit tests only): the log lines code writes while it runs.

use parking_lot::Mutex;
use std::sync::Arc;

#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The text of the log lines at `level` or above that `f` writes on this
/// thread.
pub(crate) fn logged(level: tracing::Level, f: impl FnOnce()) -> String {
    let buf = Buf::default();
    let sink = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .with_max_level(level)
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let out = buf.0.lock().clone();
    String::from_utf8(out).expect("log lines are UTF-8")
}
