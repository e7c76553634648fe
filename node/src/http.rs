//! L7 HTTP/1.1 reverse proxy: one task per client connection, which parses
//! each request head once, forwards it (hop-by-hop headers removed,
//! `X-Forwarded-For` appended) on an idle keep-alive connection to the chosen
//! service, and relays the response back, bodies as they come. Nothing is
//! allocated per request: the connection's buffers are reused, and the
//! service's idle connections are shared by every client connection
//! (`upstream`). Why it is built this way rather than on hyper: docs/performance.md.

mod h1;

use std::future::{poll_fn, Future};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::model::{VsState, Vserver};
use crate::persist::Persistence;
use crate::service::ServiceRt;
use h1::{Chunked, Framing, HeadErr};

/// How long a client may take to send a request head, idle keep-alive time
/// included (hyper's `header_read_timeout`, which the node used before).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Read buffers grow by this much; a response head may take up to
/// [`MAX_RESPONSE_HEAD`].
const CHUNK: usize = 16 * 1024;
const MAX_RESPONSE_HEAD: usize = 128 * 1024;
/// After a refused head (400, 431): how long, and how much, of the rest is
/// read and thrown away before closing, so that the client reads the answer
/// instead of a reset.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 1 << 20;

/// A cancellation one task waits for: its future is polled once (which
/// registers the task's waker), after that only the token's flag is read, so
/// that waiting costs no lock per poll.
pub(crate) struct Watch {
    token: CancellationToken,
    fut: Pin<Box<WaitForCancellationFutureOwned>>,
    armed: bool,
}

impl Watch {
    pub(crate) fn new(token: &CancellationToken) -> Self {
        Watch {
            token: token.clone(),
            fut: Box::pin(token.clone().cancelled_owned()),
            armed: false,
        }
    }

    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.armed {
            // The waker registered at the first poll is this task's, the same
            // one at every poll: the cancel wakes it.
            if self.token.is_cancelled() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        } else {
            self.armed = true;
            self.fut.as_mut().poll(cx)
        }
    }

    fn is_cancelled(&self) -> bool {
        self.token.is_cancelled()
    }
}

/// A timeout kept for the whole connection and moved only when the deadline
/// leaves its window: it fires between the deadline and `slack` after it,
/// and re-arming it is rare (a timer wheel update per request otherwise).
struct Deadline {
    sleep: Pin<Box<tokio::time::Sleep>>,
    armed: Option<Instant>,
}

impl Deadline {
    fn new() -> Self {
        Deadline {
            sleep: Box::pin(tokio::time::sleep(Duration::from_secs(86_400 * 365))),
            armed: None,
        }
    }

    fn set(&mut self, at: Instant, slack: Duration) {
        if let Some(a) = self.armed {
            if a >= at && a <= at + slack {
                return;
            }
        }
        let t = at + slack / 2;
        self.sleep.as_mut().reset(tokio::time::Instant::from_std(t));
        self.armed = Some(t);
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.sleep.as_mut().poll(cx)
    }
}

/// Why a request's exchange with a service failed.
enum Fail {
    /// Could not connect: another service may be tried.
    Connect,
    /// No response head within the response-header timeout: 504.
    Timeout,
    /// Anything else before the response head: 502.
    Bad,
    /// The node is killed, or a side went away mid-message: close.
    Abort,
}

/// A client's request once its head is read (the head for the service is in
/// the connection's `out`).
struct Req {
    head_len: usize,
    body: Framing,
    keep_alive: bool,
    http10: bool,
    is_head: bool,
    expect_continue: bool,
    /// COOKIE persistence: the service the cookie keeps it on, if it may.
    sticky: Option<usize>,
}

/// What is left of a request's body to relay.
struct BodyLeft {
    /// Bytes, for a `Content-Length` body.
    left: u64,
    /// Where a chunked body is.
    chunks: Chunked,
}

/// One in-flight request on a service: its in-flight count, and its response
/// time and traffic recorded when it ends (however it ends).
struct InFlight<'a> {
    rt: &'a ServiceRt,
    start: Instant,
    req_bytes: u64,
    resp_bytes: u64,
    /// Set when the service's response head came: only then is it a
    /// response to record.
    answered: bool,
    /// Set when the response was relayed to its end.
    end: Option<Instant>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.rt.active.fetch_sub(1, Ordering::Relaxed);
        if !self.answered {
            return;
        }
        let end = self.end.unwrap_or_else(Instant::now);
        self.rt
            .record_response(end.saturating_duration_since(self.start).as_micros() as u64);
        if self.rt.track_traffic.load(Ordering::Relaxed) {
            let pk = |b: u64| 1 + b / 1460;
            self.rt.record_traffic(
                self.req_bytes + self.resp_bytes,
                pk(self.req_bytes) + pk(self.resp_bytes),
            );
        }
    }
}

/// The state of one client connection.
struct Conn<'v> {
    vs: &'v Vserver,
    client: TcpStream,
    peer: IpAddr,
    /// The client's address as `X-Forwarded-For` names it.
    xff: Vec<u8>,
    /// Bytes read from the client; `ipos..` not consumed yet.
    inb: Vec<u8>,
    ipos: usize,
    /// The head (and first body bytes) being written, either way.
    out: Vec<u8>,
    /// Bytes read from the service.
    upb: Vec<u8>,
    kill: Watch,
    closing: Watch,
    head_timer: Deadline,
    resp_timer: Deadline,
    /// The current request's body is not all read from the client yet (the
    /// connection cannot take another request after an error then).
    body_pending: bool,
    /// The vserver's configuration snapshot, read again when its generation moves.
    st: Arc<VsState>,
    generation: u64,
}

/// Serves one client connection until it closes, the vserver closes (graceful:
/// in-flight requests finish, idle keep-alive closes) or the node is killed.
/// `client` is the client's address: the peer's, or the one a scale-out
/// primary announced (read only from the group's nodes). It is the SOURCEIP
/// persistence key and what `X-Forwarded-For` names, so that a service behind
/// a secondary sees the client, not the primary.
pub async fn serve_conn(stream: TcpStream, client: IpAddr, vs: Arc<Vserver>) {
    let _g = vs.traffic.connection();
    let _ = stream.set_nodelay(true);
    let mut c = Conn {
        vs: &vs,
        client: stream,
        peer: client,
        xff: client.to_string().into_bytes(),
        inb: Vec::with_capacity(CHUNK),
        ipos: 0,
        out: Vec::with_capacity(1024),
        upb: Vec::new(),
        kill: Watch::new(&vs.kill),
        closing: Watch::new(&vs.closing),
        head_timer: Deadline::new(),
        resp_timer: Deadline::new(),
        body_pending: false,
        generation: vs.generation(),
        st: vs.state(),
    };
    c.run().await;
}

impl Conn<'_> {
    async fn run(&mut self) {
        let mut idle_since = Instant::now();
        loop {
            let req = match self.read_request(idle_since).await {
                Ok(Some(r)) => r,
                Ok(None) => return,
                Err(e) => {
                    let (status, msg) = match e {
                        HeadErr::TooMany => (431, "request header fields too large\n"),
                        HeadErr::Invalid => (400, "bad request\n"),
                    };
                    self.refuse(status, msg).await;
                    return;
                }
            };
            match self.proxy(req).await {
                Some(end) => idle_since = end,
                None => return,
            }
        }
    }

    /// The next request head. `Ok(None)`: the connection is to close (the
    /// client closed it, was idle too long, or the vserver closes).
    async fn read_request(&mut self, idle_since: Instant) -> Result<Option<Req>, HeadErr> {
        let max = self.vs.limits.max_request_header_bytes;
        self.head_timer
            .set(idle_since + HEADER_READ_TIMEOUT, Duration::from_secs(1));
        loop {
            if self.ipos < self.inb.len() {
                self.refresh();
                let st = &self.st;
                let cookie =
                    (st.persistence == Persistence::Cookie).then_some(st.cookie_name.as_str());
                let buf = &self.inb[self.ipos..];
                match h1::request(buf, &self.xff, cookie, &mut self.out)? {
                    Some(r) => {
                        if r.head_len > max {
                            return Err(HeadErr::TooMany);
                        }
                        let sticky = r
                            .cookie
                            .and_then(|t| st.service_of_token(t))
                            .and_then(|i| st.pick_persistent(i));
                        let req = Req {
                            head_len: r.head_len,
                            body: r.body,
                            keep_alive: r.keep_alive,
                            http10: r.http10,
                            is_head: r.is_head,
                            expect_continue: r.expect_continue,
                            sticky,
                        };
                        self.ipos += req.head_len;
                        return Ok(Some(req));
                    }
                    None if buf.len() > max => return Err(HeadErr::TooMany),
                    None => {}
                }
            }
            self.make_room();
            let idle = self.ipos == self.inb.len();
            let Conn {
                client,
                inb,
                kill,
                closing,
                head_timer,
                ..
            } = self;
            tokio::select! {
                biased;
                r = client.read_buf(inb) => match r {
                    Ok(0) | Err(_) => return Ok(None),
                    Ok(_) => {}
                },
                _ = poll_fn(|cx| kill.poll(cx)) => return Ok(None),
                // Graceful close: an idle keep-alive connection closes now.
                _ = poll_fn(|cx| closing.poll(cx)), if idle => return Ok(None),
                _ = poll_fn(|cx| head_timer.poll(cx)) => return Ok(None),
            }
        }
    }

    /// Room to read more into `inb`: consumed bytes dropped, spare capacity.
    fn make_room(&mut self) {
        if self.ipos == self.inb.len() {
            self.inb.clear();
            self.ipos = 0;
        } else if self.ipos > 0 && self.inb.capacity() - self.inb.len() < CHUNK / 2 {
            self.inb.drain(..self.ipos);
            self.ipos = 0;
        }
        if self.inb.capacity() - self.inb.len() < CHUNK / 2 {
            self.inb.reserve(CHUNK);
        }
    }

    /// The vserver's current configuration snapshot.
    #[inline]
    fn refresh(&mut self) {
        let g = self.vs.generation();
        if g != self.generation {
            self.st = self.vs.state();
            self.generation = g;
        }
    }

    /// Proxies one request: the service its cookie keeps it on, else the LB
    /// method's (SOURCEIP included); one other service is tried when the first
    /// cannot be connected to. Returns when the response ended, or `None`
    /// when the connection is to close.
    async fn proxy(&mut self, req: Req) -> Option<Instant> {
        let st = self.st.clone();
        let vs = self.vs;
        self.body_pending = req.body != Framing::None;
        let Some(mut idx) = req.sticky.or_else(|| vs.pick_for(&st, self.peer, None)) else {
            return self
                .answer(&req, 503, "Service Unavailable", "no service available\n")
                .await;
        };
        vs.traffic.add_bytes(req.head_len);
        let req_bytes = req.head_len as u64
            + match req.body {
                Framing::Length(n) => n,
                _ => 0,
            };
        // The body bytes already read go with the head, in one write.
        let mut body = BodyLeft {
            left: match req.body {
                Framing::Length(n) => n,
                _ => 0,
            },
            chunks: Chunked::default(),
        };
        let avail = &self.inb[self.ipos..];
        let first = match req.body {
            Framing::Length(_) => (body.left.min(avail.len() as u64)) as usize,
            Framing::Chunked => match body.chunks.feed(avail, None) {
                Ok(n) => n,
                Err(()) => return self.answer(&req, 400, "Bad Request", "bad request\n").await,
            },
            _ => 0,
        };
        self.out.extend_from_slice(&avail[..first]);
        self.ipos += first;
        vs.traffic.add_bytes(first);
        self.body_pending = match req.body {
            Framing::Length(_) => {
                body.left -= first as u64;
                body.left > 0
            }
            Framing::Chunked => !body.chunks.done(),
            _ => false,
        };
        let mut retried = false;
        loop {
            let rt = &*st.services[idx].rt;
            rt.active.fetch_add(1, Ordering::Relaxed);
            let mut flight = InFlight {
                rt,
                start: Instant::now(),
                req_bytes,
                resp_bytes: 0,
                answered: false,
                end: None,
            };
            let r = self.exchange(&req, &mut flight, &mut body, &st, idx).await;
            let end = flight.end;
            drop(flight);
            match r {
                Ok(keep) => return keep.then(|| end.unwrap_or_else(Instant::now)),
                Err(Fail::Connect) => {
                    if !retried {
                        retried = true;
                        if let Some(j) = vs.pick_for(&st, self.peer, Some(idx)) {
                            idx = j;
                            continue;
                        }
                    }
                    return self.answer(&req, 502, "Bad Gateway", "bad gateway\n").await;
                }
                Err(Fail::Bad) => {
                    return self.answer(&req, 502, "Bad Gateway", "bad gateway\n").await
                }
                Err(Fail::Timeout) => {
                    return self
                        .answer(&req, 504, "Gateway Timeout", "gateway timeout\n")
                        .await
                }
                Err(Fail::Abort) => return None,
            }
        }
    }

    /// An idle connection to the service, or a new one. `(conn, reused)`.
    async fn upstream(&mut self, rt: &ServiceRt) -> Result<(TcpStream, bool), Fail> {
        if let Some(s) = rt.pool.pop() {
            return Ok((s, true));
        }
        let connect = rt.connect_within(&self.vs.dialer, self.vs.limits.connect_timeout);
        let kill = &mut self.kill;
        tokio::select! {
            biased;
            r = connect => match r {
                Ok(s) => Ok((s, false)),
                Err(e) => {
                    tracing::debug!(service = %rt.name, error = %e, "upstream connect failed");
                    Err(Fail::Connect)
                }
            },
            _ = poll_fn(|cx| kill.poll(cx)) => Err(Fail::Abort),
        }
    }

    /// Sends the request (its head is in `out`) to service `idx` and relays
    /// the response. `Ok(keep)`: the response was relayed, and whether the
    /// client connection stays open.
    async fn exchange(
        &mut self,
        req: &Req,
        flight: &mut InFlight<'_>,
        body: &mut BodyLeft,
        st: &VsState,
        idx: usize,
    ) -> Result<bool, Fail> {
        let rt = flight.rt;
        // What was sent can be sent again on a new connection when a reused
        // one turns out closed: the whole request, if it was in one piece.
        let replayable = !self.body_pending;

        let (mut up, mut reused) = self.upstream(rt).await?;
        loop {
            match up.write_all(&self.out).await {
                Ok(()) => break,
                Err(_) if reused && replayable => {
                    (up, reused) = self.fresh(rt).await?;
                }
                Err(_) => return Err(Fail::Bad),
            }
        }
        if self.body_pending {
            if req.expect_continue && self.ipos == self.inb.len() {
                self.write_client_bytes(b"HTTP/1.1 100 Continue\r\n\r\n")
                    .await?;
            }
            self.send_body(&mut up, req.body, body).await?;
            self.body_pending = false;
        }

        // The response head, informational responses skipped.
        let timeout = self.vs.limits.response_header_timeout;
        self.resp_timer.set(
            flight.start + timeout,
            (timeout / 16).clamp(Duration::from_millis(1), Duration::from_secs(1)),
        );
        self.upb.clear();
        let resp = loop {
            if !self.upb.is_empty() {
                match h1::response(&self.upb, req.is_head, !req.http10, &mut self.out) {
                    Ok(Some(r)) if r.status < 200 => {
                        if r.status == 101 {
                            return Err(Fail::Bad); // no upgrade was asked for
                        }
                        self.upb.drain(..r.head_len);
                        continue;
                    }
                    Ok(Some(r)) => break r,
                    Ok(None) if self.upb.len() < MAX_RESPONSE_HEAD => {}
                    Ok(None) | Err(_) => {
                        tracing::debug!(service = %rt.name, "bad response head");
                        return Err(Fail::Bad);
                    }
                }
            }
            if self.upb.capacity() - self.upb.len() < CHUNK / 2 {
                self.upb.reserve(CHUNK);
            }
            let Conn {
                upb,
                kill,
                resp_timer,
                ..
            } = self;
            let r = tokio::select! {
                biased;
                r = up.read_buf(upb) => r,
                _ = poll_fn(|cx| kill.poll(cx)) => return Err(Fail::Abort),
                _ = poll_fn(|cx| resp_timer.poll(cx)) => {
                    tracing::warn!(service = %rt.name, timeout_ms = timeout.as_millis() as u64, "no response headers in time");
                    return Err(Fail::Timeout);
                }
            };
            match r {
                Ok(n) if n > 0 => {}
                // Closed before answering: a reused connection that the
                // service had closed meanwhile; the request goes again.
                _ if reused && replayable && self.upb.is_empty() => {
                    (up, reused) = self.fresh(rt).await?;
                    if up.write_all(&self.out).await.is_err() {
                        return Err(Fail::Bad);
                    }
                }
                _ => {
                    tracing::debug!(service = %rt.name, "upstream closed before its response head");
                    return Err(Fail::Bad);
                }
            }
        };

        // The client's head: the service's, with the node's own headers.
        let vs = self.vs;
        flight.answered = true;
        vs.traffic.add_bytes(resp.head_len);
        flight.resp_bytes = resp.head_len as u64;
        let to_client = match resp.body {
            Framing::Chunked if req.http10 => Framing::Close, // decoded, then closed
            f => f,
        };
        let keep = req.keep_alive && to_client != Framing::Close && !self.closing.is_cancelled();
        let out = &mut self.out;
        for (k, v) in [
            (&b"x-lbscale-node: "[..], vs.node_hv.as_bytes()),
            (b"x-lbscale-service: ", rt.name_hv.as_bytes()),
        ] {
            out.extend_from_slice(k);
            out.extend_from_slice(v);
            out.extend_from_slice(b"\r\n");
        }
        if req.sticky != Some(idx) && st.persistence == Persistence::Cookie {
            if let Some(c) = st.set_cookie(idx) {
                out.extend_from_slice(b"set-cookie: ");
                out.extend_from_slice(c.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
        }
        if !keep {
            out.extend_from_slice(b"connection: close\r\n");
        } else if req.http10 {
            out.extend_from_slice(b"connection: keep-alive\r\n");
        }
        out.extend_from_slice(b"\r\n");

        // The body: what came with the head first, in the same write.
        let mut left = match resp.body {
            Framing::Length(n) => n,
            _ => 0,
        };
        let mut chunks = Chunked::default();
        let decode = resp.body == Framing::Chunked && req.http10;
        let mut reusable = resp.reusable;
        let mut pos = resp.head_len;
        let mut done =
            self.take_body(resp.body, &mut pos, &mut left, &mut chunks, decode, flight)?;
        if pos < self.upb.len() && done {
            reusable = false; // bytes past the response: not a connection to reuse
        }
        self.write_client_out().await?;
        while !done {
            self.upb.clear();
            if self.upb.capacity() < CHUNK {
                self.upb.reserve(CHUNK);
            }
            let Conn { upb, kill, .. } = self;
            let r = tokio::select! {
                biased;
                r = up.read_buf(upb) => r,
                _ = poll_fn(|cx| kill.poll(cx)) => return Err(Fail::Abort),
            };
            match r {
                Ok(n) if n > 0 => {}
                _ if resp.body == Framing::Close => break,
                // The service closed mid-body: the client's response is cut.
                _ => return Err(Fail::Abort),
            }
            let mut pos = 0;
            self.out.clear();
            done = self.take_body(resp.body, &mut pos, &mut left, &mut chunks, decode, flight)?;
            if pos < self.upb.len() {
                reusable = false;
            }
            self.write_client_out().await?;
        }
        flight.end = Some(Instant::now());
        if reusable && !rt.is_draining() && rt.is_up() {
            // Not back to the pool of a service that went DOWN (its pool was
            // emptied then) or drains: it must be reached afresh.
            rt.pool.push(up);
        }
        Ok(keep)
    }

    /// Moves the response body bytes of `upb[*pos..]` into `out` (decoded
    /// when `decode`); `Ok(true)` at the body's end.
    fn take_body(
        &mut self,
        body: Framing,
        pos: &mut usize,
        left: &mut u64,
        chunks: &mut Chunked,
        decode: bool,
        flight: &mut InFlight<'_>,
    ) -> Result<bool, Fail> {
        let avail = &self.upb[*pos..];
        let (n, done) = match body {
            Framing::None => (0, true),
            Framing::Length(_) => {
                let n = (*left).min(avail.len() as u64) as usize;
                *left -= n as u64;
                self.out.extend_from_slice(&avail[..n]);
                (n, *left == 0)
            }
            Framing::Chunked => {
                let n = if decode {
                    chunks.feed(avail, Some(&mut self.out))
                } else {
                    chunks
                        .feed(avail, None)
                        .inspect(|n| self.out.extend_from_slice(&avail[..*n]))
                }
                .map_err(|_| Fail::Abort)?;
                (n, chunks.done())
            }
            Framing::Close => {
                self.out.extend_from_slice(avail);
                (avail.len(), false)
            }
        };
        *pos += n;
        self.vs.traffic.add_bytes(n);
        flight.resp_bytes += n as u64;
        Ok(done)
    }

    /// A new connection to the service, for a request that a reused one could
    /// not take.
    async fn fresh(&mut self, rt: &ServiceRt) -> Result<(TcpStream, bool), Fail> {
        let connect = rt.connect_within(&self.vs.dialer, self.vs.limits.connect_timeout);
        let kill = &mut self.kill;
        tokio::select! {
            biased;
            r = connect => r.map(|s| (s, false)).map_err(|_| Fail::Bad),
            _ = poll_fn(|cx| kill.poll(cx)) => Err(Fail::Abort),
        }
    }

    /// Relays the rest of the request body from the client to the service.
    async fn send_body(
        &mut self,
        up: &mut TcpStream,
        framing: Framing,
        body: &mut BodyLeft,
    ) -> Result<(), Fail> {
        loop {
            self.make_room();
            let Conn {
                client, inb, kill, ..
            } = self;
            let r = tokio::select! {
                biased;
                r = client.read_buf(inb) => r,
                _ = poll_fn(|cx| kill.poll(cx)) => return Err(Fail::Abort),
            };
            match r {
                Ok(n) if n > 0 => {}
                _ => return Err(Fail::Abort), // the client went away mid-body
            }
            let avail = &self.inb[self.ipos..];
            let (n, done) = match framing {
                Framing::Length(_) => {
                    let n = body.left.min(avail.len() as u64) as usize;
                    body.left -= n as u64;
                    (n, body.left == 0)
                }
                _ => {
                    let n = body.chunks.feed(avail, None).map_err(|_| Fail::Abort)?;
                    (n, body.chunks.done())
                }
            };
            if up.write_all(&avail[..n]).await.is_err() {
                return Err(Fail::Bad);
            }
            self.ipos += n;
            self.vs.traffic.add_bytes(n);
            if done {
                return Ok(());
            }
        }
    }

    async fn write_client_out(&mut self) -> Result<(), Fail> {
        let Conn {
            client, out, kill, ..
        } = self;
        if out.is_empty() {
            return Ok(());
        }
        tokio::select! {
            biased;
            r = client.write_all(out) => r.map_err(|_| Fail::Abort),
            _ = poll_fn(|cx| kill.poll(cx)) => Err(Fail::Abort),
        }
    }

    async fn write_client_bytes(&mut self, b: &[u8]) -> Result<(), Fail> {
        self.client.write_all(b).await.map_err(|_| Fail::Abort)
    }

    /// Answers the request itself (no service could). Returns as
    /// [`Conn::proxy`] does: the connection stays open unless the client
    /// closes it or the request's body was not read.
    async fn answer(&mut self, req: &Req, status: u16, reason: &str, msg: &str) -> Option<Instant> {
        let keep = req.keep_alive && !self.body_pending && !self.closing.is_cancelled();
        self.simple(status, reason, msg, keep);
        self.write_client_out().await.ok()?;
        keep.then(Instant::now)
    }

    /// A response of the node's own into `out`.
    fn simple(&mut self, status: u16, reason: &str, msg: &str, keep: bool) {
        let out = &mut self.out;
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(h1::itoa(u64::from(status), &mut [0; 20]));
        out.push(b' ');
        out.extend_from_slice(reason.as_bytes());
        out.extend_from_slice(b"\r\ncontent-type: text/plain\r\nx-lbscale-node: ");
        out.extend_from_slice(self.vs.node_hv.as_bytes());
        out.extend_from_slice(b"\r\ncontent-length: ");
        out.extend_from_slice(h1::itoa(msg.len() as u64, &mut [0; 20]));
        if !keep {
            out.extend_from_slice(b"\r\nconnection: close");
        }
        out.extend_from_slice(b"\r\n\r\n");
        out.extend_from_slice(msg.as_bytes());
    }

    /// Answers a head that cannot be served, then closes: what the client
    /// still sends is read (a little while, a bounded amount) so that it gets
    /// the answer rather than a reset.
    async fn refuse(&mut self, status: u16, msg: &str) {
        let reason = if status == 431 {
            "Request Header Fields Too Large"
        } else {
            "Bad Request"
        };
        self.simple(status, reason, msg, false);
        if self.write_client_out().await.is_err() {
            return;
        }
        let _ = self.client.shutdown().await;
        let linger = async {
            let mut sink = [0u8; 4096];
            let mut total = 0;
            while total < LINGER_BYTES {
                match self.client.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => total += n,
                }
            }
        };
        let _ = tokio::time::timeout(LINGER, linger).await;
    }
}
