//! The fallback of the gRPC port: every path other than the method served
//! on `h2` directly (health, reflection, any other service) is handed to
//! tonic's [`Routes`] on a task of its own, its request and response bodies
//! streamed both ways (a health `Watch` or a reflection stream stays open).

use bytes::Bytes;
use h2::RecvStream;
use h2::server::SendResponse;
use http::{Request, Response};
use http_body::{Body as _, Frame};
use std::future::poll_fn;
use std::pin::Pin;
use std::task::{Context, Poll};
use tonic::codegen::Service as _;
use tonic::service::Routes;

/// Hands a request for another path to tonic and streams its answer back
/// (health `Watch` streams included), until the body ends or the client
/// resets the stream. `_stream` is the stream's share of the process-wide
/// budget, held as long as the stream is served (an answer waits for
/// window here, in tonic's body, not in h2).
pub(super) async fn forward(
    mut routes: Routes,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    _stream: crate::conn_limit::RequestBytes,
) {
    type Req = Request<tonic::body::Body>;
    let req: Req = req.map(|b| {
        tonic::body::Body::new(H2Body {
            inner: b,
            data_done: false,
        })
    });
    // The router is always ready, and never fails (unknown paths get
    // UNIMPLEMENTED).
    let Ok(()) = poll_fn(|cx| tonic::codegen::Service::<Req>::poll_ready(&mut routes, cx)).await;
    let Ok(resp) = routes.call(req).await;
    let (parts, mut body) = resp.into_parts();
    let end = body.is_end_stream();
    let Ok(mut send) = respond.send_response(Response::from_parts(parts, ()), end) else {
        return;
    };
    if end {
        return;
    }
    loop {
        let frame = tokio::select! {
            f = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)) => f,
            _ = poll_fn(|cx| send.poll_reset(cx)) => return,
        };
        let frame: Frame<Bytes> = match frame {
            None => {
                let _ = send.send_data(Bytes::new(), true);
                return;
            }
            Some(Err(_)) => {
                send.send_reset(h2::Reason::INTERNAL_ERROR);
                return;
            }
            Some(Ok(f)) => f,
        };
        match frame.into_data() {
            Ok(mut data) => {
                while !data.is_empty() {
                    send.reserve_capacity(data.len());
                    // Capacity, or None once the client reset the stream.
                    // A peer that grants no window for ANSWER_WINDOW_TIMEOUT
                    // gets the stream reset, which gives its share of the
                    // budget back (as a unary answer's).
                    let n = tokio::time::timeout(
                        super::h2::ANSWER_WINDOW_TIMEOUT,
                        poll_fn(|cx| {
                            if send.poll_reset(cx).is_ready() {
                                return Poll::Ready(None);
                            }
                            send.poll_capacity(cx)
                        }),
                    )
                    .await;
                    let Ok(n) = n else {
                        send.send_reset(h2::Reason::CANCEL);
                        return;
                    };
                    let Some(Ok(n)) = n else { return };
                    let chunk = data.split_to(n.min(data.len()));
                    if send.send_data(chunk, false).is_err() {
                        return;
                    }
                }
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    let _ = send.send_trailers(trailers);
                    return;
                }
            }
        }
    }
}

/// An h2 request body as an [`http_body::Body`] for tonic, returning the
/// flow-control capacity of each chunk as it is read.
struct H2Body {
    inner: RecvStream,
    data_done: bool,
}

impl http_body::Body for H2Body {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        if !self.data_done {
            match self.inner.poll_data(cx) {
                Poll::Ready(Some(Ok(b))) => {
                    let _ = self.inner.flow_control().release_capacity(b.len());
                    return Poll::Ready(Some(Ok(Frame::data(b))));
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => self.data_done = true,
                Poll::Pending => return Poll::Pending,
            }
        }
        match self.inner.poll_trailers(cx) {
            Poll::Ready(Ok(Some(t))) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Poll::Ready(Ok(None)) => Poll::Ready(None),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}
