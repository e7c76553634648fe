//! L7 HTTP/1.1 reverse proxy: one task per client connection, which parses
//! each request head once, forwards it (hop-by-hop headers removed,
//! `X-Forwarded-For` appended) on an idle keep-alive connection to the chosen
//! service, and relays the response back, bodies as they come. Nothing is
//! allocated per request: the connection's buffers are reused, and the
//! service's idle connections are shared by every client connection
//! (`upstream`). Why it is built this way rather than on hyper: docs/performance.md.
//!
//! What keeps it safe in front of services that parse differently: a chunked
//! body is written out again by the node (never forwarded as it came, its
//! trailers left out, a malformed one refused) and its framing fields are
//! the node's own both ways; a request with both `Transfer-Encoding` and
//! `Content-Length`, or another coding than `chunked`, is refused; only a
//! bodiless GET, HEAD or OPTIONS is ever sent twice; a request body that stops
//! coming is answered 408; a service's complete answer before the whole body
//! was sent is relayed (the body stopped if it refuses, else sent alongside;
//! both connections closed after).
//!
//! What keeps it bounded: every wait of an exchange has a timeout (the
//! response-header timeout, as an idle timeout once the head is relayed), the
//! client is watched for closing while its response is relayed, and the
//! node's kill and the service's drain kill end an exchange at once.

mod h1;

use std::future::{poll_fn, Future};
use std::io::ErrorKind;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::cancel::Watch;
use crate::model::{VsState, Vserver};
use crate::persist::Persistence;
use crate::service::ServiceRt;
use h1::{Chunked, Emit, Framing, HeadErr};

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
/// Entries one request may try to connect to: the first choice, and the ones
/// after a refused connection (a DOWN service not yet marked so, a ramp peer
/// that has just gone).
const CONNECT_TRIES: usize = 3;

/// How far past its deadline a timer of `timeout` may fire (see [`Deadline`]).
fn slack(timeout: Duration) -> Duration {
    (timeout / 16).clamp(Duration::from_millis(1), Duration::from_secs(1))
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

/// What ends a connection's exchanges at once: the node's kill, and the kill
/// of the service an exchange is on (its drain timed out), as the L4 relay
/// watches. A connection keeps one watch per service it has used, so that
/// switching services costs no allocation per request. A service is held
/// weakly in that list: a removed one is not kept alive by it (its health
/// checks and SOURCEIP entries end with it), and its address is not reused
/// while held.
struct Kills {
    node: Watch,
    /// Per service: its watch, and whether it was polled once (the waker
    /// registered).
    services: Vec<(Weak<ServiceRt>, Watch, bool)>,
    /// The service the current exchange is on, and its watch.
    cur: Option<(usize, Arc<ServiceRt>)>,
}

/// Service watches one connection keeps at most (more: all dropped, rare).
const MAX_SERVICE_WATCHES: usize = 32;

impl Kills {
    /// Watches `rt`'s kill from now until [`Kills::none`].
    fn on(&mut self, rt: &Arc<ServiceRt>) {
        let at = Arc::as_ptr(rt);
        let i = match self.services.iter().position(|(r, ..)| r.as_ptr() == at) {
            Some(i) => i,
            None => {
                if self.services.len() >= MAX_SERVICE_WATCHES {
                    self.services.clear();
                }
                let w = Watch::new(&rt.kill_token());
                self.services.push((Arc::downgrade(rt), w, false));
                self.services.len() - 1
            }
        };
        self.cur = Some((i, rt.clone()));
    }

    fn none(&mut self) {
        self.cur = None;
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Kills {
            node,
            services,
            cur,
        } = self;
        if node.poll(cx).is_ready() {
            return Poll::Ready(());
        }
        let Some((i, rt)) = cur else {
            return Poll::Pending;
        };
        let (_, w, polled) = &mut services[*i];
        // Once its waker is registered, the watch is read only while the
        // service drains (its kill comes only then): an atomic load at each
        // wake-up rather than the token's lock.
        if *polled && !rt.is_draining() {
            return Poll::Pending;
        }
        *polled = true;
        if w.poll(cx).is_pending() {
            return Poll::Pending;
        }
        // The token of an earlier drain, replaced since (the service was
        // enabled again, and drains anew): the current one is watched.
        let t = rt.kill_token();
        if t.is_cancelled() {
            return Poll::Ready(());
        }
        *w = Watch::new(&t);
        w.poll(cx)
    }
}

/// Why a request's exchange with a service failed.
enum Fail {
    /// Could not connect: another service may be tried.
    Connect,
    /// No response head within the response-header timeout, or the service
    /// took no more of the request body for as long: 504.
    Timeout,
    /// The client sent no more of its request body for the response-header
    /// timeout: 408, and the connection closes.
    ClientTimeout,
    /// The client's chunked body is malformed: 400, and the connection closes.
    BadRequest,
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
    /// May be sent again on a new connection (see [`h1::Request::replayable`]).
    replayable: bool,
    /// COOKIE persistence: the service the cookie keeps it on, if it may.
    sticky: Option<usize>,
}

/// What the service's answer before the whole request body was sent means.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Early {
    /// No answer: the body was all sent.
    No,
    /// A refusal (4xx, 5xx), or the service closed: the body stops there, and
    /// both connections close after the response.
    Stop,
    /// Any other answer: the rest of the body follows alongside the
    /// response; both connections close after it.
    Continue,
}

/// Where a response's body is.
struct RespBody<'a> {
    framing: Framing,
    /// Bytes left, for a `Content-Length` body.
    left: &'a mut u64,
    chunks: &'a mut Chunked,
    /// A chunked body decoded (for an HTTP/1.0 client).
    decode: bool,
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
    /// Request body bytes the service has yet to take, after an early answer.
    sbuf: Vec<u8>,
    kill: Kills,
    closing: Watch,
    head_timer: Deadline,
    /// The request body's idle timeout while it is sent, then the response
    /// head's timeout.
    resp_timer: Deadline,
    /// The current request's body is not all read from the client yet (the
    /// connection cannot take another request after the response then).
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
        sbuf: Vec::new(),
        kill: Kills {
            node: Watch::new(&vs.kill),
            services: Vec::new(),
            cur: None,
        },
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
                        HeadErr::Coding => (501, "transfer coding not implemented\n"),
                    };
                    self.refuse(status, msg).await;
                    return;
                }
            };
            match self.proxy(req).await {
                Some(end) => idle_since = end,
                None => {
                    // What the client still sends of a body is read a while,
                    // so that it reads the answer rather than a reset.
                    if self.body_pending && !self.vs.kill.is_cancelled() {
                        self.linger().await;
                    }
                    return;
                }
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
                            replayable: r.replayable,
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
    /// method's (SOURCEIP included); up to [`CONNECT_TRIES`] entries are tried
    /// when one cannot be connected to (see [`Vserver::pick_after_failure`]).
    /// Returns when the response ended, or `None` when the connection is to
    /// close.
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
            Framing::Length(_) => {
                let n = (body.left.min(avail.len() as u64)) as usize;
                self.out.extend_from_slice(&avail[..n]);
                n
            }
            Framing::Chunked => match body.chunks.feed(avail, Emit::Chunks(&mut self.out)) {
                Ok(n) => n,
                Err(()) => return self.answer(&req, 400, "Bad Request", "bad request\n").await,
            },
            _ => 0,
        };
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
        // Only on the failure path: no allocation per request.
        let mut tried: Vec<usize> = Vec::new();
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
            self.kill.on(&st.services[idx].rt);
            let r = self.exchange(&req, &mut flight, &mut body, &st, idx).await;
            self.kill.none();
            let end = flight.end;
            drop(flight);
            match r {
                Ok(keep) => return keep.then(|| end.unwrap_or_else(Instant::now)),
                Err(Fail::Connect) => {
                    tried.push(idx);
                    if tried.len() < CONNECT_TRIES {
                        if let Some(j) = vs.pick_after_failure(&st, self.peer, &tried) {
                            idx = j;
                            continue;
                        }
                    }
                    return self.answer(&req, 502, "Bad Gateway", "bad gateway\n").await;
                }
                Err(Fail::ClientTimeout) => {
                    return self
                        .answer(&req, 408, "Request Timeout", "request timeout\n")
                        .await
                }
                Err(Fail::BadRequest) => {
                    return self.answer(&req, 400, "Bad Request", "bad request\n").await
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
    /// For a request that cannot be sent twice, an idle connection is asked
    /// first (one system call) whether the service closed it meanwhile.
    async fn upstream(
        &mut self,
        rt: &ServiceRt,
        replayable: bool,
    ) -> Result<(TcpStream, bool), Fail> {
        while let Some(s) = rt.pool.pop() {
            if replayable || crate::upstream::still_open(&s) {
                return Ok((s, true));
            }
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
        let (mut up, mut reused) = self.upstream(rt, req.replayable).await?;
        self.upb.clear();
        let timeout = self.vs.limits.response_header_timeout;
        // Whether the service answered before the whole body was sent.
        let mut early = Early::No;
        if self.body_pending {
            early = self.send_body(&up, rt, req, body).await?;
        } else {
            loop {
                let Conn {
                    out,
                    kill,
                    resp_timer,
                    ..
                } = self;
                match write_bounded(&mut up, out, kill, resp_timer, timeout).await {
                    Ok(()) => break,
                    // Sent again only if nothing of it can have been taken
                    // as a request that has effects.
                    Err(WriteErr::Io) if reused && req.replayable => {
                        (up, reused) = self.fresh(rt).await?;
                    }
                    Err(e) => return Err(e.towards_service()),
                }
            }
        }

        // The response head, informational responses skipped; its timeout
        // runs from the end of the request.
        self.resp_timer
            .set(Instant::now() + timeout, slack(timeout));
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
                // Closed without a byte of answer: a reused connection that
                // the service had closed meanwhile. A bodiless GET, HEAD or
                // OPTIONS goes again on a new one; any other request may
                // have been acted on, and is answered 502.
                _ if reused && req.replayable && self.upb.is_empty() => {
                    (up, reused) = self.fresh(rt).await?;
                    let Conn {
                        out,
                        kill,
                        resp_timer,
                        ..
                    } = self;
                    write_bounded(&mut up, out, kill, resp_timer, timeout)
                        .await
                        .map_err(WriteErr::towards_service)?;
                    // The response header timeout runs from this request.
                    self.resp_timer
                        .set(Instant::now() + timeout, slack(timeout));
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
        // After an early answer the request body may not be all sent (or
        // read): neither connection takes another request.
        let keep = req.keep_alive
            && early == Early::No
            && to_client != Framing::Close
            && !vs.closing.is_cancelled();
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
        let mut reusable = resp.reusable && early == Early::No;
        let mut pos = resp.head_len;
        let mut rb = RespBody {
            framing: resp.body,
            left: &mut left,
            chunks: &mut chunks,
            decode,
        };
        let done = self.take_body(&mut rb, &mut pos, flight)?;
        if pos < self.upb.len() && done {
            reusable = false; // bytes past the response: not a connection to reuse
        }
        self.write_client_out().await?;
        // After an early answer that did not refuse the body, the rest of
        // the body goes to the service alongside the response.
        let sending = early == Early::Continue && self.body_pending;
        if !done || sending {
            reusable &= self
                .relay_rest(&mut up, rt, req, body, sending, &mut rb, done, flight)
                .await?;
        }
        flight.end = Some(Instant::now());
        if reusable && !rt.is_draining() && rt.is_up() {
            // Not back to the pool of a service that went DOWN (its pool was
            // emptied then) or drains: it must be reached afresh.
            rt.pool.push(up);
        }
        Ok(keep)
    }

    /// Moves the response body bytes of `upb[*pos..]` into `out` (a chunked
    /// body decoded when `decode`, else written out again); `Ok(true)` at the
    /// body's end.
    fn take_body(
        &mut self,
        rb: &mut RespBody<'_>,
        pos: &mut usize,
        flight: &mut InFlight<'_>,
    ) -> Result<bool, Fail> {
        let avail = &self.upb[*pos..];
        let (n, done) = match rb.framing {
            Framing::None => (0, true),
            Framing::Length(_) => {
                let n = (*rb.left).min(avail.len() as u64) as usize;
                *rb.left -= n as u64;
                self.out.extend_from_slice(&avail[..n]);
                (n, *rb.left == 0)
            }
            Framing::Chunked => {
                let emit = if rb.decode {
                    Emit::Data(&mut self.out)
                } else {
                    Emit::Chunks(&mut self.out)
                };
                // A malformed body: the client's response is cut.
                let n = rb.chunks.feed(avail, emit).map_err(|_| Fail::Abort)?;
                (n, rb.chunks.done())
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

    /// Relays what is left once the response head is sent: the response
    /// body to the client and, when `sending` (an early answer that did not
    /// refuse it), the rest of the request body to the service alongside,
    /// each way only as the other side takes it. Ends the exchange (`Abort`)
    /// when either side takes or sends nothing for the idle timeout (the
    /// response-header timeout), when the client closes, or at a kill (the
    /// node's, or the service's at the end of its drain). `Ok(clean)`: the
    /// response ended where its framing says, with nothing after it.
    #[allow(clippy::too_many_arguments)]
    async fn relay_rest(
        &mut self,
        up: &mut TcpStream,
        rt: &ServiceRt,
        req: &Req,
        body: &mut BodyLeft,
        mut sending: bool,
        rb: &mut RespBody<'_>,
        mut done: bool,
        flight: &mut InFlight<'_>,
    ) -> Result<bool, Fail> {
        let idle = self.vs.limits.response_header_timeout;
        let slack = slack(idle);
        self.resp_timer.set(Instant::now() + idle, slack);
        let mut clean = true;
        // `out` (to the client) is all written on entry; `sbuf[spos..]` is
        // what the service has yet to take.
        let mut cpos = self.out.len();
        let mut spos = 0;
        if !sending {
            self.sbuf.clear();
        }
        // The client is watched for closing while nothing of its is buffered
        // (bytes it sends meanwhile, a pipelined request, are kept).
        let mut watch = !sending && self.ipos == self.inb.len();
        loop {
            let to_client = cpos < self.out.len();
            let to_service = spos < self.sbuf.len();
            if sending && !to_service && !self.body_pending {
                sending = false; // the whole body is sent
            }
            if done && !to_client && !sending {
                if clean {
                    // A read that would block clears the service's read
                    // readiness (a successful `try_read` leaves it set, and
                    // the pool would take its idle connection for closed);
                    // bytes past the response, or a close: not reused.
                    let mut b = [0u8; 1];
                    clean =
                        matches!(up.try_read(&mut b), Err(e) if e.kind() == ErrorKind::WouldBlock);
                }
                return Ok(clean);
            }
            let read_up = !done && !to_client;
            let read_client = if sending { !to_service } else { watch };
            if read_up && self.upb.capacity() < CHUNK {
                self.upb.reserve(CHUNK);
            }
            if read_client {
                self.make_room();
            }
            let Conn {
                client,
                kill,
                resp_timer,
                ..
            } = self;
            let client = &*client;
            let up_r = &*up;
            let ev = tokio::select! {
                biased;
                _ = poll_fn(|cx| kill.poll(cx)) => return Err(Fail::Abort),
                r = up_r.readable(), if read_up => r.map(|_| 0),
                r = client.writable(), if to_client => r.map(|_| 1),
                r = up_r.writable(), if to_service => r.map(|_| 2),
                r = client.readable(), if read_client => r.map(|_| 3),
                _ = poll_fn(|cx| resp_timer.poll(cx)) => {
                    tracing::warn!(service = %rt.name, timeout_ms = idle.as_millis() as u64, "an L7 exchange idle too long; closed");
                    return Err(Fail::Abort);
                }
            };
            let progress = match ev {
                Err(_) => return Err(Fail::Abort),
                Ok(0) => {
                    self.upb.clear();
                    match up.try_read_buf(&mut self.upb) {
                        Ok(n) if n > 0 => {
                            self.out.clear();
                            cpos = 0;
                            let mut pos = 0;
                            done = self.take_body(rb, &mut pos, flight)?;
                            if pos < self.upb.len() {
                                clean = false;
                            }
                            true
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => false,
                        // Closed: the end of a body until close, else the
                        // client's response is cut.
                        _ if rb.framing == Framing::Close => {
                            done = true;
                            true
                        }
                        _ => return Err(Fail::Abort),
                    }
                }
                Ok(1) => match self.client.try_write(&self.out[cpos..]) {
                    Ok(n) => {
                        cpos += n;
                        true
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => false,
                    Err(_) => return Err(Fail::Abort),
                },
                Ok(2) => match up.try_write(&self.sbuf[spos..]) {
                    Ok(n) => {
                        spos += n;
                        true
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => false,
                    // The service takes no more of the body: the response
                    // goes on, the connections close after it.
                    Err(_) => {
                        sending = false;
                        clean = false;
                        self.sbuf.clear();
                        spos = 0;
                        true
                    }
                },
                _ => match self.client.try_read_buf(&mut self.inb) {
                    Ok(0) => return Err(Fail::Abort), // the client went away
                    Ok(_) if sending => {
                        self.sbuf.clear();
                        spos = 0;
                        let n = self.feed_body(req, body).map_err(|_| Fail::Abort)?;
                        self.ipos += n;
                        self.vs.traffic.add_bytes(n);
                        n > 0
                    }
                    Ok(_) => {
                        watch = false;
                        false
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => false,
                    Err(_) => return Err(Fail::Abort),
                },
            };
            if progress {
                self.resp_timer.set(Instant::now() + idle, slack);
            }
        }
    }

    /// Moves the request body bytes of `inb[ipos..]` into `sbuf` (a chunked
    /// body written out again); how many were taken. `Err`: a malformed
    /// chunked body.
    fn feed_body(&mut self, req: &Req, body: &mut BodyLeft) -> Result<usize, ()> {
        let avail = &self.inb[self.ipos..];
        match req.body {
            Framing::Length(_) => {
                let n = body.left.min(avail.len() as u64) as usize;
                body.left -= n as u64;
                self.sbuf.extend_from_slice(&avail[..n]);
                self.body_pending = body.left > 0;
                Ok(n)
            }
            _ => {
                let n = body.chunks.feed(avail, Emit::Chunks(&mut self.sbuf))?;
                self.body_pending = !body.chunks.done();
                Ok(n)
            }
        }
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

    /// Sends `out` (the head and the body bytes that came with it) and the
    /// rest of the request body to the service, reading the client only as
    /// the service takes it, and watching the service meanwhile. Stalling
    /// for the response-header timeout ends it: the client's side 408, the
    /// service's 504. An answer of the service before the whole body was
    /// sent counts once its final head is complete (interim ones dropped, a
    /// head in pieces waited for): a refusal (4xx, 5xx) or the service
    /// closing stops the body (`Early::Stop`); any other answer
    /// (`Early::Continue`, what is unsent in `sbuf`) lets the rest of the
    /// body follow alongside the response (RFC 9112 §9.3).
    async fn send_body(
        &mut self,
        up: &TcpStream,
        rt: &ServiceRt,
        req: &Req,
        body: &mut BodyLeft,
    ) -> Result<Early, Fail> {
        let idle = self.vs.limits.response_header_timeout;
        let slack = slack(idle);
        self.resp_timer.set(Instant::now() + idle, slack);
        // `Expect: 100-continue` is answered once the head is sent, unless
        // body bytes came with it (the client did not wait).
        let mut continued = !req.expect_continue || self.ipos < self.inb.len();
        let mut wpos = 0;
        // What an early final answer means for the body.
        let early = |status: u16, continued: bool| {
            if status >= 400 || status == 0 || !continued {
                Early::Stop
            } else {
                Early::Continue
            }
        };
        loop {
            if wpos < self.out.len() {
                let Conn {
                    out,
                    kill,
                    resp_timer,
                    upb,
                    sbuf,
                    ..
                } = self;
                tokio::select! {
                    biased;
                    _ = poll_fn(|cx| kill.poll(cx)) => return Err(Fail::Abort),
                    r = up.readable() => {
                        let st = if r.is_err() { Some(0) } else { answered_early(up, upb) };
                        if let Some(st) = st {
                            let e = early(st, continued);
                            if e == Early::Continue {
                                sbuf.clear();
                                sbuf.extend_from_slice(&out[wpos..]);
                            }
                            return Ok(e);
                        }
                    }
                    r = up.writable() => {
                        if r.is_err() {
                            return Ok(Early::Stop); // its answer, if any, is read next
                        }
                        match up.try_write(&out[wpos..]) {
                            Ok(n) => {
                                wpos += n;
                                resp_timer.set(Instant::now() + idle, slack);
                            }
                            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                            Err(_) => return Ok(Early::Stop),
                        }
                    }
                    _ = poll_fn(|cx| resp_timer.poll(cx)) => {
                        tracing::warn!(service = %rt.name, "the service takes no more of the request body");
                        return Err(Fail::Timeout);
                    }
                }
                continue;
            }
            if !self.body_pending {
                return Ok(Early::No);
            }
            if !continued {
                continued = true;
                let Conn {
                    client,
                    kill,
                    resp_timer,
                    ..
                } = self;
                write_bounded(
                    client,
                    b"HTTP/1.1 100 Continue\r\n\r\n",
                    kill,
                    resp_timer,
                    idle,
                )
                .await
                .map_err(|_| Fail::Abort)?;
                self.resp_timer.set(Instant::now() + idle, slack);
            }
            self.out.clear();
            wpos = 0;
            self.make_room();
            let Conn {
                client,
                inb,
                kill,
                resp_timer,
                upb,
                sbuf,
                ..
            } = self;
            let r = tokio::select! {
                biased;
                _ = poll_fn(|cx| kill.poll(cx)) => return Err(Fail::Abort),
                r = up.readable() => {
                    let st = if r.is_err() { Some(0) } else { answered_early(up, upb) };
                    if let Some(st) = st {
                        sbuf.clear();
                        return Ok(early(st, continued));
                    }
                    continue;
                }
                r = client.read_buf(inb) => r,
                _ = poll_fn(|cx| resp_timer.poll(cx)) => return Err(Fail::ClientTimeout),
            };
            match r {
                Ok(n) if n > 0 => {}
                _ => return Err(Fail::Abort), // the client went away mid-body
            }
            self.resp_timer.set(Instant::now() + idle, slack);
            // `out` is the service's part here: the body fed into it.
            std::mem::swap(&mut self.out, &mut self.sbuf);
            let r = self.feed_body(req, body);
            std::mem::swap(&mut self.out, &mut self.sbuf);
            let n = r.map_err(|_| Fail::BadRequest)?;
            self.ipos += n;
            self.vs.traffic.add_bytes(n);
        }
    }

    async fn write_client_out(&mut self) -> Result<(), Fail> {
        let idle = self.vs.limits.response_header_timeout;
        let Conn {
            client,
            out,
            kill,
            resp_timer,
            ..
        } = self;
        if out.is_empty() {
            return Ok(());
        }
        write_bounded(client, out, kill, resp_timer, idle)
            .await
            .map_err(|_| Fail::Abort)
    }

    /// Answers the request itself (no service could). Returns as
    /// [`Conn::proxy`] does: the connection stays open unless the client
    /// closes it or the request's body was not read.
    async fn answer(&mut self, req: &Req, status: u16, reason: &str, msg: &str) -> Option<Instant> {
        let keep = req.keep_alive && !self.body_pending && !self.vs.closing.is_cancelled();
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
        let reason = match status {
            431 => "Request Header Fields Too Large",
            501 => "Not Implemented",
            _ => "Bad Request",
        };
        self.simple(status, reason, msg, false);
        if self.write_client_out().await.is_err() {
            return;
        }
        self.linger().await;
    }

    /// Closes the client's side for writing, then reads (a little while, a
    /// bounded amount) and drops what the client still sends, so that a
    /// closing with unread bytes does not reset the answer away.
    async fn linger(&mut self) {
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

/// After the service's side turned readable while a request body is sent:
/// reads what it sent into `upb`, interim (1xx) responses dropped. The status
/// of a complete final head; `Some(0)` when the service closed or sent what
/// is no head; `None` for nothing yet, or a head still in pieces.
fn answered_early(up: &TcpStream, upb: &mut Vec<u8>) -> Option<u16> {
    if upb.capacity() - upb.len() < CHUNK / 2 {
        upb.reserve(CHUNK);
    }
    match up.try_read_buf(upb) {
        Ok(0) => Some(0),
        Ok(_) => {
            while let Some(n) = h1::interim(upb) {
                upb.drain(..n);
            }
            if upb.is_empty() {
                return None;
            }
            match h1::head_status(upb) {
                None if upb.len() < MAX_RESPONSE_HEAD => None,
                None => Some(0),
                s => s,
            }
        }
        Err(e) if e.kind() == ErrorKind::WouldBlock => None,
        Err(_) => Some(0),
    }
}

/// Why [`write_bounded`] failed.
enum WriteErr {
    Io,
    Killed,
    /// The peer took nothing for the idle timeout.
    Idle,
}

impl WriteErr {
    /// What a failed write of the request to the service makes of the
    /// exchange (towards the client, any failure closes: `Fail::Abort`).
    fn towards_service(self) -> Fail {
        match self {
            WriteErr::Killed => Fail::Abort,
            WriteErr::Idle => Fail::Timeout,
            WriteErr::Io => Fail::Bad,
        }
    }
}

/// Writes all of `buf` to `s`, bounded: a kill ends it, and so does a peer
/// that takes nothing for `idle`. The timer is armed only once the socket's
/// buffer is full, so that a write that goes at once reads no clock.
async fn write_bounded(
    s: &mut TcpStream,
    buf: &[u8],
    kill: &mut Kills,
    timer: &mut Deadline,
    idle: Duration,
) -> Result<(), WriteErr> {
    let mut pos = 0;
    let mut armed = false;
    poll_fn(|cx| {
        while pos < buf.len() {
            match Pin::new(&mut *s).poll_write(cx, &buf[pos..]) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(Err(WriteErr::Io)),
                Poll::Ready(Ok(n)) => {
                    pos += n;
                    armed = false; // progress: idle anew from the next stall
                }
                Poll::Pending => {
                    if kill.poll(cx).is_ready() {
                        return Poll::Ready(Err(WriteErr::Killed));
                    }
                    if !armed {
                        armed = true;
                        timer.set(Instant::now() + idle, slack(idle));
                    }
                    if timer.poll(cx).is_ready() {
                        return Poll::Ready(Err(WriteErr::Idle));
                    }
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(Ok(()))
    })
    .await
}
