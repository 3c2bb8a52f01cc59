//! Many requests per script call: the requests that arrive while the calls
//! to one Redis node are in flight are sent together in the next call
//! (docs/design.md, "Batched script calls").
//!
//! Each node (a single node, the Sentinel master) and each Cluster hash slot has
//! one [`BatchQueue`] and one task that drains it: with no call in flight,
//! or one in flight and a lone request queued, it takes the next request
//! and every request queued behind it (at most [`MAX_BATCH_REQUESTS`]
//! requests and [`MAX_BATCH_CHARGES`] charges), sends them as one script
//! call ([`ScriptCall::batch`]) and hands each request its own outcome.
//! There is no timer: a lone request is sent at once, alone, in the same
//! call it would have had without batching, unless [`MAX_IN_FLIGHT`] calls
//! are in flight; several queued requests wait until no call is in flight
//! and go together. Before it starts a call with none in flight, the task
//! yields to the scheduler once, so that the request tasks already ready to
//! run (their requests decoded, about to be queued) queue theirs first and
//! go in the same call: under load that makes calls about half as many
//! again as large (BENCHMARKS.md); at rest it costs one pass of the
//! scheduler.
//!
//! What stays per request is done by the request itself, in
//! [`Pipeline::apply`](super::Pipeline::apply): the local over-limit cache,
//! the circuit breaker (asked before queueing, told the outcome after), the
//! timeout (counted from the request's own arrival: a request still queued
//! when it runs out is never sent) and the cache record. A failed call fails
//! each of its requests with the error it would have had alone.

use super::script::ScriptCall;
use crate::storage::{BackendKind, RequestResult, StorageError};
use std::future::Future;
use std::sync::Weak;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::{mpsc, oneshot};

/// Most requests in one script call. The script holds Redis for the whole
/// call: 128 one-descriptor requests run in about 0.3 ms of Redis time.
pub const MAX_BATCH_REQUESTS: usize = 128;

/// Most charges (descriptors) in one script call, whatever the number of
/// requests; a request with more charges than this goes alone.
pub const MAX_BATCH_CHARGES: usize = 512;

/// Script calls of one queue in flight at once. Two: a lone request that
/// arrives while one call is in flight is sent at once, as without
/// batching (a request queued behind a call waits up to a round trip more,
/// which at moderate rates showed in the p99); several queued requests
/// wait until no call is in flight and go together in one call (fewer,
/// larger calls when busy).
pub const MAX_IN_FLIGHT: usize = 2;

/// A request's outcome, and whether a call was sent for it (an error
/// before anything was sent does not count in the circuit breaker).
pub(crate) type Outcome = (Result<RequestResult, StorageError>, bool);

/// One queued request: its prepared call and where its outcome goes.
pub(crate) struct Queued {
    pub(crate) call: ScriptCall,
    pub(crate) reply: oneshot::Sender<Outcome>,
}

/// The queue of one node's batching task.
#[derive(Clone, Debug)]
pub(crate) struct BatchQueue {
    tx: mpsc::UnboundedSender<Queued>,
    /// Whether the task is waiting for a connection (Sentinel: no master
    /// known yet), so that a request that runs out of time meanwhile fails
    /// as it would have alone ([`ConnSource::no_connection`]).
    connecting: std::sync::Arc<AtomicBool>,
}

/// What the batching task serves: a node (or a Cluster hash slot) that
/// runs one script call for the queued requests `batch`, through
/// [`Pipeline::call_batch`], and answers one [`Outcome`] per request, in
/// order. `connecting` is set while the call waits for a connection.
pub(crate) trait BatchTarget: Send + Sync + 'static {
    /// One call for `batch`.
    fn call_batch<'a>(
        &'a self,
        batch: &'a [Queued],
        connecting: &'a AtomicBool,
    ) -> impl Future<Output = Vec<Outcome>> + Send + 'a;
}

impl BatchQueue {
    /// A queue and its task, which serves `target` while it lives and ends
    /// when the queue is dropped. Must be called inside a Tokio runtime.
    pub(crate) fn spawn<T: BatchTarget>(target: Weak<T>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let connecting = std::sync::Arc::new(AtomicBool::new(false));
        tokio::spawn(drive(target, rx, connecting.clone()));
        Self { tx, connecting }
    }

    /// Whether the task is waiting for a connection now.
    pub(crate) fn connecting(&self) -> bool {
        self.connecting.load(Ordering::Relaxed)
    }

    /// Queues `call`; the receiver gets its outcome.
    pub(crate) fn push(&self, call: ScriptCall) -> oneshot::Receiver<Outcome> {
        let (reply, rx) = oneshot::channel();
        // The task ends only after the queue is dropped: the send cannot
        // fail while `self` lives; if it did, the dropped sender answers
        // the request with an internal error.
        let _ = self.tx.send(Queued { call, reply });
        rx
    }
}

/// The task of one queue: up to [`MAX_IN_FLIGHT`] script calls at a time,
/// each with every request queued when it starts (up to the bounds).
async fn drive<T: BatchTarget>(
    target: Weak<T>,
    mut rx: mpsc::UnboundedReceiver<Queued>,
    connecting: std::sync::Arc<AtomicBool>,
) {
    use futures::StreamExt as _;
    let mut carry: Option<Queued> = None;
    let mut in_flight = futures::stream::FuturesUnordered::new();
    let mut open = true;
    loop {
        // Start calls while there is room and a request waits. With a call
        // in flight, a second one starts at once only for a lone request
        // (a moderate rate: it goes as it would without batching); when
        // more wait (the node is busy), they wait until no call is in
        // flight and go together, in fewer and larger calls.
        while in_flight.len() < MAX_IN_FLIGHT {
            if !in_flight.is_empty() && rx.len() + usize::from(carry.is_some()) > 1 {
                break;
            }
            // No call in flight: let the tasks that are ready queue their
            // requests first (one pass of the scheduler, no timer), so that
            // they go in this call rather than wait for the next one.
            if in_flight.is_empty() && (carry.is_some() || !rx.is_empty()) {
                tokio::task::yield_now().await;
            }
            let Some(first) = carry.take().or_else(|| rx.try_recv().ok()) else {
                break;
            };
            let batch = take_batch(first, &mut rx, &mut carry);
            if batch.is_empty() {
                continue;
            }
            let Some(owner) = target.upgrade() else {
                return;
            };
            let connecting = connecting.clone();
            in_flight.push(async move {
                let outcomes = owner.call_batch(&batch, &connecting).await;
                for (q, outcome) in batch.into_iter().zip(outcomes) {
                    let _ = q.reply.send(outcome);
                }
            });
        }
        if !open && in_flight.is_empty() && carry.is_none() {
            return;
        }
        let room = in_flight.len() < MAX_IN_FLIGHT && carry.is_none() && open;
        tokio::select! {
            Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
            q = rx.recv(), if room => match q {
                Some(q) => carry = Some(q),
                None => open = false,
            },
            // (Not reached: with no call in flight there is room.)
            else => return,
        }
    }
}

/// `first` and every request queued behind it, up to the bounds (a request
/// that would pass the charge bound is left in `carry` for the next call),
/// without those whose caller gave up (timed out, cancelled) while queued:
/// they are never sent.
fn take_batch(
    first: Queued,
    rx: &mut mpsc::UnboundedReceiver<Queued>,
    carry: &mut Option<Queued>,
) -> Vec<Queued> {
    let mut charges = first.call.charges;
    let mut batch = vec![first];
    while batch.len() < MAX_BATCH_REQUESTS {
        let Ok(q) = rx.try_recv() else { break };
        if charges + q.call.charges > MAX_BATCH_CHARGES {
            *carry = Some(q);
            break;
        }
        charges += q.call.charges;
        batch.push(q);
    }
    batch.retain(|q| !q.reply.is_closed());
    batch
}

/// The outcome of a request whose batching task went away before
/// answering (the backend is being dropped).
pub(crate) fn lost() -> StorageError {
    StorageError::backend(
        BackendKind::Internal,
        "the Redis batching task ended before answering",
    )
}

/// A copy of `e` for another request of the same failed call: the same
/// variant, kind and message; the source error is kept as its message.
pub(crate) fn share(e: &StorageError) -> StorageError {
    let source = |s: &Option<crate::storage::ErrorSource>| {
        s.as_ref()
            .map(|s| Box::new(Shared(s.to_string())) as crate::storage::ErrorSource)
    };
    match e {
        StorageError::Timeout(d) => StorageError::Timeout(*d),
        StorageError::CircuitOpen => StorageError::CircuitOpen,
        StorageError::Unreachable { message, source: s } => StorageError::Unreachable {
            message: message.clone(),
            source: source(s),
        },
        StorageError::Backend {
            kind,
            message,
            source: s,
        } => StorageError::Backend {
            kind: *kind,
            message: message.clone(),
            source: source(s),
        },
    }
}

/// The message of the error that failed a whole call, as the source of
/// each request's copy ([`share`]).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Shared(String);
