//! L7 HTTP/1.1 reverse proxy: hyper server towards clients (keep-alive), pooled
//! hyper client connections towards each service.

use std::convert::Infallible;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode, Version};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpStream;

use crate::model::{VsState, Vserver};
use crate::persist::{find_cookie, Persistence};
use crate::service::ServiceRt;
use crate::upstream::{Conn, UpBody};

/// Tracks one proxied request until its response body is finished: in-flight
/// count, response time, and returns the upstream connection to the pool.
pub struct RespGuard {
    rt: Arc<ServiceRt>,
    sender: Option<Conn>,
    /// The vserver the request came through (its node's throughput).
    vs: Arc<Vserver>,
    start: Instant,
    done: bool,
    /// Bytes of this exchange (request head estimate + response), for the
    /// LEASTBANDWIDTH/LEASTPACKETS estimators.
    req_bytes: u64,
    resp_bytes: u64,
}

impl Drop for RespGuard {
    fn drop(&mut self) {
        self.rt.active.fetch_sub(1, Ordering::Relaxed);
        self.rt
            .record_response(self.start.elapsed().as_micros() as u64);
        if self.rt.track_traffic.load(Ordering::Relaxed) {
            let pk = |b: u64| 1 + b / 1460;
            self.rt.record_traffic(
                self.req_bytes + self.resp_bytes,
                pk(self.req_bytes) + pk(self.resp_bytes),
            );
        }
        if self.done {
            if let Some(s) = self.sender.take() {
                // Not back to the pool of a service that went DOWN meanwhile (its
                // pool was emptied then): it must be reached afresh when UP again.
                if !s.is_closed() && !self.rt.is_draining() && self.rt.is_up() {
                    self.rt.pool.push(s);
                }
            }
        }
    }
}

pub enum RespBody {
    Full(Option<Bytes>),
    Proxied { body: Incoming, guard: RespGuard },
}

impl Body for RespBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            RespBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            RespBody::Proxied { body, guard } => {
                let r = Pin::new(body).poll_frame(cx);
                match &r {
                    Poll::Ready(Some(Ok(f))) => {
                        if let Some(d) = f.data_ref() {
                            guard.vs.traffic.add_bytes(d.len());
                            guard.resp_bytes += d.len() as u64;
                        }
                    }
                    Poll::Ready(None) => guard.done = true,
                    _ => {}
                }
                r
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RespBody::Full(b) => b.is_none(),
            RespBody::Proxied { body, .. } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RespBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            RespBody::Full(None) => SizeHint::with_exact(0),
            RespBody::Proxied { body, .. } => body.size_hint(),
        }
    }
}

impl Drop for RespBody {
    fn drop(&mut self) {
        if let RespBody::Proxied { body, guard } = self {
            if body.is_end_stream() {
                guard.done = true;
            }
        }
    }
}

static X_LBSCALE_NODE: HeaderName = HeaderName::from_static("x-lbscale-node");
static X_LBSCALE_SERVICE: HeaderName = HeaderName::from_static("x-lbscale-service");
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

fn simple(vs: &Vserver, status: StatusCode, msg: &'static str) -> Response<RespBody> {
    let mut r = Response::new(RespBody::Full(Some(Bytes::from_static(msg.as_bytes()))));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    h.insert(X_LBSCALE_NODE.clone(), vs.node_hv.clone());
    r
}

/// Approximate wire size of a header block (name: value\r\n each).
#[inline]
fn head_len(h: &HeaderMap) -> usize {
    h.iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum::<usize>()
        + 2
}

/// Removes hop-by-hop headers (RFC 9110 §7.6.1), including those named by Connection.
fn strip_hop(h: &mut HeaderMap) {
    if let Some(c) = h.get(header::CONNECTION) {
        if let Ok(s) = c.to_str() {
            let named: Vec<String> = s
                .split(',')
                .map(|t| t.trim().to_ascii_lowercase())
                .filter(|t| !t.is_empty())
                .collect();
            for n in named {
                if let Ok(n) = HeaderName::from_bytes(n.as_bytes()) {
                    h.remove(n);
                }
            }
        }
        h.remove(header::CONNECTION);
    }
    h.remove(&KEEP_ALIVE);
    h.remove(&PROXY_CONNECTION);
    h.remove(header::TE);
    h.remove(header::TRAILER);
    h.remove(header::TRANSFER_ENCODING);
    h.remove(header::UPGRADE);
}

/// Entries one request may try to connect to: the first choice, and the ones
/// after a refused connection (a DOWN service not yet marked so, a ramp peer
/// that has just gone).
const CONNECT_TRIES: usize = 3;

enum SendErr {
    /// Could not connect: the request is handed back for another service.
    Connect(Box<Request<UpBody>>),
    /// No response headers within the response-header timeout.
    Timeout,
    Other,
}

/// Sends `req` on `s` and waits for the response's headers, at most the
/// vserver's response-header timeout. `Err(Some(req))`: the connection went
/// away before sending (try another).
async fn exchange(
    rt: &ServiceRt,
    vs: &Vserver,
    s: &mut Conn,
    req: Request<UpBody>,
) -> Result<Response<Incoming>, Result<Request<UpBody>, SendErr>> {
    let timeout = vs.limits.response_header_timeout;
    match tokio::time::timeout(timeout, s.try_send_request(req)).await {
        Ok(Ok(resp)) => Ok(resp),
        Ok(Err(mut e)) => match e.take_message() {
            Some(r) => Err(Ok(r)),
            None => {
                tracing::debug!(service = %rt.name, error = %e.error(), "upstream request failed");
                Err(Err(SendErr::Other))
            }
        },
        Err(_) => {
            tracing::warn!(service = %rt.name, timeout_ms = timeout.as_millis() as u64, "no response headers in time");
            Err(Err(SendErr::Timeout))
        }
    }
}

async fn send(
    rt: &ServiceRt,
    vs: &Vserver,
    mut req: Request<UpBody>,
) -> Result<(Response<Incoming>, Conn), SendErr> {
    while let Some(mut s) = rt.pool.pop() {
        if !s.is_ready() {
            match tokio::time::timeout(Duration::from_secs(1), s.ready()).await {
                Ok(Ok(())) => {}
                _ => continue,
            }
        }
        match exchange(rt, vs, &mut s, req).await {
            Ok(resp) => return Ok((resp, s)),
            Err(Ok(r)) => req = r, // connection went away before sending: next one
            Err(Err(e)) => return Err(e),
        }
    }
    let stream = match rt
        .connect_within(&vs.dialer, vs.limits.connect_timeout)
        .await
    {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(service = %rt.name, error = %e, "upstream connect failed");
            return Err(SendErr::Connect(Box::new(req)));
        }
    };
    let (mut s, conn) = match hyper::client::conn::http1::Builder::new()
        .writev(false)
        .handshake(TokioIo::new(stream))
        .await
    {
        Ok(x) => x,
        Err(_) => return Err(SendErr::Connect(Box::new(req))),
    };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    match exchange(rt, vs, &mut s, req).await {
        Ok(resp) => Ok((resp, s)),
        Err(Ok(_)) => Err(SendErr::Other),
        Err(Err(e)) => Err(e),
    }
}

/// The vserver's configuration snapshot as one client connection sees it: read
/// again only when the vserver's generation moved.
struct CachedState {
    generation: u64,
    state: Arc<VsState>,
}

/// COOKIE: the service the request's cookie keeps it on, when it may take it.
fn cookie_service(st: &VsState, req: &Request<Incoming>) -> Option<usize> {
    match st.persistence {
        Persistence::Cookie => find_cookie(req.headers(), &st.cookie_name)
            .and_then(|t| st.service_of_token(t))
            .and_then(|i| st.pick_persistent(i)),
        _ => None,
    }
}

/// Names the client in `X-Forwarded-For`: appended to the list the client
/// sent (its fields joined into one, as proxies do), else the only entry.
#[inline]
fn forwarded_for(h: &mut HeaderMap, client: HeaderValue) {
    let mut prior = h.get_all(&X_FORWARDED_FOR).iter();
    let Some(first) = prior.next() else {
        h.insert(X_FORWARDED_FOR.clone(), client);
        return;
    };
    let mut list = first.as_bytes().to_vec();
    for more in prior {
        list.extend_from_slice(b", ");
        list.extend_from_slice(more.as_bytes());
    }
    list.extend_from_slice(b", ");
    list.extend_from_slice(client.as_bytes());
    let v = HeaderValue::from_bytes(&list).unwrap_or(client);
    h.insert(X_FORWARDED_FOR.clone(), v);
}

/// The client's request as it goes to a service: hop-by-hop headers removed,
/// `X-Forwarded-For` ending with the client, origin form, HTTP/1.1. Returns it with
/// its size (head estimate and announced body), which the node's throughput
/// counts for the head now (the body as it passes).
fn upstream_request(
    req: Request<Incoming>,
    vs: &Vserver,
    xff: HeaderValue,
) -> (Request<UpBody>, u64) {
    let (mut parts, body) = req.into_parts();
    let req_head = head_len(&parts.headers) + parts.uri.path().len() + 16;
    vs.traffic.add_bytes(req_head);
    let req_bytes = req_head as u64
        + parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    strip_hop(&mut parts.headers);
    forwarded_for(&mut parts.headers, xff);
    if parts.uri.authority().is_some() {
        if let Some(pq) = parts.uri.path_and_query() {
            if let Ok(u) = pq.as_str().parse() {
                parts.uri = u;
            }
        }
    }
    parts.version = Version::HTTP_11;
    let req = Request::from_parts(parts, UpBody::new(body, vs.traffic.clone()));
    (req, req_bytes)
}

/// The service's response as it goes to the client: hop-by-hop headers
/// removed, the node and service named, a persistence cookie when the request
/// was balanced anew; `guard` (its `resp_bytes` still 0) tracks it until its
/// body ends.
fn client_response(
    resp: Response<Incoming>,
    st: &VsState,
    idx: usize,
    new_cookie: bool,
    mut guard: RespGuard,
) -> Response<RespBody> {
    let (mut parts, body) = resp.into_parts();
    let resp_head = head_len(&parts.headers) + 17;
    guard.vs.traffic.add_bytes(resp_head);
    guard.resp_bytes = resp_head as u64;
    strip_hop(&mut parts.headers);
    parts
        .headers
        .insert(X_LBSCALE_NODE.clone(), guard.vs.node_hv.clone());
    parts
        .headers
        .insert(X_LBSCALE_SERVICE.clone(), guard.rt.name_hv.clone());
    if new_cookie && st.persistence == Persistence::Cookie {
        if let Some(c) = st.set_cookie(idx) {
            parts.headers.append(header::SET_COOKIE, c.clone());
        }
    }
    Response::from_parts(parts, RespBody::Proxied { body, guard })
}

/// Proxies one request: the service its cookie keeps it on, else the LB
/// method's (SOURCEIP included); up to [`CONNECT_TRIES`] entries are tried when
/// one cannot be connected to (see [`Vserver::pick_after_failure`]).
async fn proxy(
    req: Request<Incoming>,
    vs: Arc<Vserver>,
    st: Arc<VsState>,
    xff: HeaderValue,
    client: IpAddr,
) -> Response<RespBody> {
    let sticky = cookie_service(&st, &req);
    let Some(mut idx) = sticky.or_else(|| vs.pick_for(&st, client, None)) else {
        return simple(
            &vs,
            StatusCode::SERVICE_UNAVAILABLE,
            "no service available\n",
        );
    };
    let (mut req, req_bytes) = upstream_request(req, &vs, xff);
    // Only on the failure path: no allocation per request.
    let mut tried: Vec<usize> = Vec::new();
    loop {
        let rt = st.services[idx].rt.clone();
        rt.active.fetch_add(1, Ordering::Relaxed);
        let start = Instant::now();
        match send(&rt, &vs, req).await {
            Ok((resp, sender)) => {
                let guard = RespGuard {
                    rt,
                    sender: Some(sender),
                    vs,
                    start,
                    done: false,
                    req_bytes,
                    resp_bytes: 0,
                };
                return client_response(resp, &st, idx, sticky != Some(idx), guard);
            }
            Err(SendErr::Connect(r)) => {
                rt.active.fetch_sub(1, Ordering::Relaxed);
                tried.push(idx);
                if tried.len() < CONNECT_TRIES {
                    if let Some(j) = vs.pick_after_failure(&st, client, &tried) {
                        idx = j;
                        req = *r;
                        continue;
                    }
                }
                return simple(&vs, StatusCode::BAD_GATEWAY, "bad gateway\n");
            }
            Err(SendErr::Other) => {
                rt.active.fetch_sub(1, Ordering::Relaxed);
                return simple(&vs, StatusCode::BAD_GATEWAY, "bad gateway\n");
            }
            Err(SendErr::Timeout) => {
                rt.active.fetch_sub(1, Ordering::Relaxed);
                return simple(&vs, StatusCode::GATEWAY_TIMEOUT, "gateway timeout\n");
            }
        }
    }
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
    let xff =
        HeaderValue::from_str(&client.to_string()).unwrap_or(HeaderValue::from_static("unknown"));
    let vs2 = vs.clone();
    let cache = std::sync::Mutex::new(CachedState {
        generation: vs.generation(),
        state: vs.state(),
    });
    let svc = hyper::service::service_fn(move |req| {
        let vs = vs2.clone();
        let st = {
            // Uncontended: only this connection's task takes it.
            let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
            let g = vs.generation();
            if g != c.generation {
                c.state = vs.state();
                c.generation = g;
            }
            c.state.clone()
        };
        let xff = xff.clone();
        async move { Ok::<_, Infallible>(proxy(req, vs, st, xff, client).await) }
    });
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(TokioTimer::new())
        .writev(false)
        .keep_alive(true)
        .header_read_timeout(Duration::from_secs(30))
        // A longer head is answered 431 (Request Header Fields Too Large).
        .max_buf_size(vs.limits.max_request_header_bytes);
    let conn = b.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = vs.closing.cancelled() => {}
        _ = vs.kill.cancelled() => return,
    }
    conn.as_mut().graceful_shutdown();
    tokio::select! {
        _ = conn.as_mut() => {}
        _ = vs.kill.cancelled() => {}
    }
}
