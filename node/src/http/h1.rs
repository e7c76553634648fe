//! HTTP/1.x framing for the L7 proxy: a head is parsed once (httparse, into
//! slices of the read buffer) and the head forwarded is written straight from
//! those slices, hop-by-hop headers left out; bodies are relayed as they come,
//! their framing (length, chunked, until close) followed by a small state
//! machine. A chunked body is written out again by the node (sizes, data, its
//! own last chunk), never forwarded as it came: what a peer parses differently
//! (a bare LF, a trailer line) is refused or left out, not passed on. No header
//! map, no allocation per request (see docs/performance.md).

use std::mem::MaybeUninit;

/// Headers a head may have; more is answered 431, as hyper did.
pub const MAX_HEADERS: usize = 100;
/// A chunk-size line's extensions, and a chunked body's trailer section, at most.
const MAX_CHUNK_LINE: usize = 4096;
const MAX_TRAILERS: usize = 16 * 1024;

/// Why a head cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadErr {
    /// Malformed, or a framing that cannot be followed safely: 400 (502 from a service).
    Invalid,
    /// More headers than [`MAX_HEADERS`]: 431.
    TooMany,
    /// A request's `Transfer-Encoding` other than exactly `chunked`: 501.
    Coding,
}

/// How a message's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body.
    None,
    Length(u64),
    Chunked,
    /// Until the sender closes (a response only).
    Close,
}

/// The headers a proxy deals with itself; every other one is forwarded as it came.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Name {
    Other,
    /// Hop-by-hop (RFC 9110 §7.6.1), never forwarded: Keep-Alive,
    /// Proxy-Connection, TE, Trailer, Upgrade.
    Hop,
    Connection,
    TransferEncoding,
    ContentLength,
    Cookie,
    XForwardedFor,
    Expect,
    Host,
    /// `X-LBSCALE-Node`, `X-LBSCALE-Service`: the node sets its own on a
    /// response; a service's are not passed on.
    Own,
}

#[inline]
fn classify(n: &[u8]) -> Name {
    let is = |s: &str| n.eq_ignore_ascii_case(s.as_bytes());
    match n.len() {
        2 if is("te") => Name::Hop,
        4 if is("host") => Name::Host,
        6 if is("cookie") => Name::Cookie,
        6 if is("expect") => Name::Expect,
        7 if is("trailer") || is("upgrade") => Name::Hop,
        10 if is("connection") => Name::Connection,
        10 if is("keep-alive") => Name::Hop,
        14 if is("content-length") => Name::ContentLength,
        14 if is("x-lbscale-node") => Name::Own,
        15 if is("x-forwarded-for") => Name::XForwardedFor,
        16 if is("proxy-connection") => Name::Hop,
        17 if is("transfer-encoding") => Name::TransferEncoding,
        17 if is("x-lbscale-service") => Name::Own,
        _ => Name::Other,
    }
}

/// The comma-separated tokens of a header value, trimmed, empty ones left out.
fn tokens(v: &[u8]) -> impl Iterator<Item = &[u8]> {
    v.split(|b| *b == b',').map(trim).filter(|t| !t.is_empty())
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// What the `Connection` headers of a head say: `close`, `keep-alive`, and
/// the other headers they name (hop-by-hop too).
#[derive(Default)]
struct ConnectionTokens<'a> {
    close: bool,
    keep_alive: bool,
    /// Names of other headers; allocated only when there are some.
    named: Vec<&'a [u8]>,
}

impl<'a> ConnectionTokens<'a> {
    fn read(headers: &[httparse::Header<'a>]) -> Self {
        let mut c = ConnectionTokens::default();
        for h in headers {
            if h.name.len() == 10 && h.name.eq_ignore_ascii_case("connection") {
                for t in tokens(h.value) {
                    if t.eq_ignore_ascii_case(b"close") {
                        c.close = true;
                    } else if t.eq_ignore_ascii_case(b"keep-alive") {
                        c.keep_alive = true;
                    } else {
                        c.named.push(t);
                    }
                }
            }
        }
        c
    }

    #[inline]
    fn names(&self, n: &[u8]) -> bool {
        !self.named.is_empty() && self.named.iter().any(|t| t.eq_ignore_ascii_case(n))
    }
}

/// `Content-Length`: every field must agree on one number.
fn content_length(acc: &mut Option<u64>, v: &[u8]) -> Result<(), HeadErr> {
    for t in v.split(|b| *b == b',').map(trim) {
        if t.is_empty() || t.len() > 19 || !t.iter().all(u8::is_ascii_digit) {
            return Err(HeadErr::Invalid);
        }
        let n = t.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        match *acc {
            Some(m) if m != n => return Err(HeadErr::Invalid),
            _ => *acc = Some(n),
        }
    }
    Ok(())
}

/// Whether the last transfer coding of `Transfer-Encoding` is `chunked`.
fn chunked_last(v: &[u8]) -> bool {
    tokens(v)
        .last()
        .is_some_and(|t| t.eq_ignore_ascii_case(b"chunked"))
}

/// Whether `Transfer-Encoding` is `chunked` alone: the one coding the node
/// writes out again itself, so that what a service (or client) reads is the
/// node's single layer, never a list parsers may read differently
/// (`identity, chunked`, `chunked, chunked`).
fn chunked_only(v: &[u8]) -> bool {
    let mut t = tokens(v);
    t.next().is_some_and(|t| t.eq_ignore_ascii_case(b"chunked")) && t.next().is_none()
}

#[inline]
fn header_line(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// A client's request, parsed from the start of the read buffer.
pub struct Request<'a> {
    /// Bytes of the head (request line to the empty line).
    pub head_len: usize,
    pub body: Framing,
    /// Whether the client keeps the connection open after the response.
    pub keep_alive: bool,
    /// HTTP/1.0 (else 1.1).
    pub http10: bool,
    pub is_head: bool,
    /// `Expect: 100-continue` (answered by the node, not forwarded).
    pub expect_continue: bool,
    /// A bodiless GET, HEAD or OPTIONS: safe to send again on a new service
    /// connection when a reused one closed without answering (RFC 9110
    /// §9.2.2; stricter than "idempotent": no body, no side effect).
    pub replayable: bool,
    /// The value of the persistence cookie, when asked for and present.
    pub cookie: Option<&'a str>,
}

/// Parses the request at the start of `buf` and writes the head to send to a
/// service into `out` (cleared first): origin form, HTTP/1.1, hop-by-hop
/// headers left out, one `X-Forwarded-For` ending with `client`, the empty
/// line. `Ok(None)`: the head is not complete yet. `cookie_name`: the
/// persistence cookie to look for.
pub fn request<'a>(
    buf: &'a [u8],
    client: &[u8],
    cookie_name: Option<&str>,
    out: &mut Vec<u8>,
) -> Result<Option<Request<'a>>, HeadErr> {
    let mut hs: [MaybeUninit<httparse::Header<'a>>; MAX_HEADERS] =
        [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let head_len = match req.parse_with_uninit_headers(buf, &mut hs) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadErr::TooMany),
        Err(_) => return Err(HeadErr::Invalid),
    };
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return Err(HeadErr::Invalid);
    };
    // A tunnel is not what a reverse proxy of services offers.
    if method == "CONNECT" {
        return Err(HeadErr::Invalid);
    }
    let http10 = version == 0;
    let headers = &*req.headers;
    let conn = ConnectionTokens::read(headers);

    out.clear();
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    // An absolute-form target's authority is the Host sent (RFC 9112 §3.2.2).
    let authority = origin_form(target, out)?;
    out.extend_from_slice(b" HTTP/1.1\r\n");

    let mut length = None;
    let mut te: Option<&[u8]> = None;
    let mut xff: Option<(usize, usize)> = None; // first and last index of the fields
    let mut expect_continue = false;
    let mut cookie = None;
    let mut hosts = 0;
    for (i, h) in headers.iter().enumerate() {
        let n = h.name.as_bytes();
        match classify(n) {
            Name::Hop | Name::Connection => continue,
            Name::Host => {
                hosts += 1;
                if let Some(a) = authority {
                    header_line(out, b"Host", a);
                    continue;
                }
            }
            Name::ContentLength => {
                content_length(&mut length, h.value)?;
                continue; // written below, unless chunked framing wins
            }
            Name::TransferEncoding => {
                // Two fields: their codings concatenated; one is enough here.
                if te.is_some() {
                    return Err(HeadErr::Invalid);
                }
                te = Some(h.value);
                continue;
            }
            Name::XForwardedFor => {
                xff = Some((xff.map_or(i, |(f, _)| f), i));
                continue;
            }
            Name::Expect if h.value.eq_ignore_ascii_case(b"100-continue") => {
                // No 1xx to an HTTP/1.0 client (RFC 9110 §15.2).
                expect_continue = !http10;
                continue;
            }
            Name::Cookie => {
                if let (Some(name), None) = (cookie_name, cookie) {
                    cookie = std::str::from_utf8(h.value)
                        .ok()
                        .and_then(|v| crate::persist::cookie_in(v, name));
                }
            }
            _ => {}
        }
        if conn.names(n) {
            continue;
        }
        header_line(out, n, h.value);
    }
    // HTTP/1.1 needs exactly one Host (RFC 9112 §3.2), and so does a
    // service that routes by it.
    if hosts > 1 || (hosts == 0 && !http10) {
        return Err(HeadErr::Invalid);
    }
    if let (0, Some(a)) = (hosts, authority) {
        header_line(out, b"Host", a);
    }
    let body = match (te, length) {
        // Both: a request that two parsers may frame differently (smuggling,
        // RFC 9112 §6.3): refused, and the connection closed.
        (Some(_), Some(_)) => return Err(HeadErr::Invalid),
        // HTTP/1.0 has no transfer codings.
        (Some(_), _) if http10 => return Err(HeadErr::Invalid),
        // Any other coding than chunked alone: not implemented (501).
        (Some(v), _) if !chunked_only(v) => return Err(HeadErr::Coding),
        (Some(_), _) => {
            // The node's own: it writes the chunks out again itself.
            out.extend_from_slice(b"Transfer-Encoding: chunked\r\n");
            Framing::Chunked
        }
        (None, Some(0)) | (None, None) => {
            if length.is_some() {
                out.extend_from_slice(b"Content-Length: 0\r\n");
            }
            Framing::None
        }
        (None, Some(n)) => {
            out.extend_from_slice(b"Content-Length: ");
            out.extend_from_slice(itoa(n, &mut [0; 20]));
            out.extend_from_slice(b"\r\n");
            Framing::Length(n)
        }
    };
    // One field: the client's own list (its fields joined), then the client.
    out.extend_from_slice(b"X-Forwarded-For: ");
    if let Some((first, last)) = xff {
        for h in &headers[first..=last] {
            // An empty value would make the list start with an empty element.
            if classify(h.name.as_bytes()) == Name::XForwardedFor && !trim(h.value).is_empty() {
                out.extend_from_slice(trim(h.value));
                out.extend_from_slice(b", ");
            }
        }
    }
    out.extend_from_slice(client);
    out.extend_from_slice(b"\r\n\r\n");
    Ok(Some(Request {
        head_len,
        body,
        keep_alive: if http10 {
            conn.keep_alive && !conn.close
        } else {
            !conn.close
        },
        http10,
        is_head: method == "HEAD",
        expect_continue,
        replayable: body == Framing::None && matches!(method, "GET" | "HEAD" | "OPTIONS"),
        cookie,
    }))
}

/// Writes the target in origin form: an absolute-form one's path and query
/// (`http://host/p?q` → `/p?q`, `http://host?q` → `/?q`), any other as it is.
/// Returns an absolute-form target's authority (its host and port, without
/// user information); an empty one is refused.
fn origin_form<'t>(target: &'t str, out: &mut Vec<u8>) -> Result<Option<&'t [u8]>, HeadErr> {
    if !target.starts_with('/') {
        if let Some(i) = target.find("://") {
            let rest = &target[i + 3..];
            let end = rest.find(['/', '?']).unwrap_or(rest.len());
            let (auth, pq) = rest.split_at(end);
            let auth = auth.rsplit_once('@').map_or(auth, |(_, h)| h);
            if auth.is_empty() {
                return Err(HeadErr::Invalid);
            }
            if !pq.starts_with('/') {
                out.push(b'/');
            }
            out.extend_from_slice(pq.as_bytes());
            return Ok(Some(auth.as_bytes()));
        }
    }
    out.extend_from_slice(target.as_bytes());
    Ok(None)
}

/// A service's response, parsed from the start of the read buffer.
pub struct Response {
    pub head_len: usize,
    pub status: u16,
    pub body: Framing,
    /// Whether the service's connection may take another request afterwards.
    pub reusable: bool,
}

/// Parses the response at the start of `buf` to a request (`is_head`: to a
/// HEAD) and writes the head for the client into `out` (cleared first):
/// status line, headers other than hop-by-hop ones, `Transfer-Encoding:
/// chunked` when `chunked_ok` and the body is chunked; not the empty line (the
/// caller adds its own headers). `Ok(None)`: not complete yet. An
/// informational (1xx) response is returned as such, with `out` untouched.
pub fn response(
    buf: &[u8],
    is_head: bool,
    chunked_ok: bool,
    out: &mut Vec<u8>,
) -> Result<Option<Response>, HeadErr> {
    let mut hs: [MaybeUninit<httparse::Header<'_>>; MAX_HEADERS] =
        [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let head_len = match httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut resp, buf, &mut hs)
    {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadErr::TooMany),
        Err(_) => return Err(HeadErr::Invalid),
    };
    let (Some(version), Some(status)) = (resp.version, resp.code) else {
        return Err(HeadErr::Invalid);
    };
    if (100..200).contains(&status) {
        return Ok(Some(Response {
            head_len,
            status,
            body: Framing::None,
            reusable: true,
        }));
    }
    let headers = &*resp.headers;
    let conn = ConnectionTokens::read(headers);
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(itoa(u64::from(status), &mut [0; 20]));
    out.push(b' ');
    out.extend_from_slice(resp.reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut length = None;
    let mut te: Option<&[u8]> = None;
    for h in headers {
        let n = h.name.as_bytes();
        // The framing fields are the node's own, written below from what it
        // parsed (a `Connection` naming them removes nothing: RFC 9110
        // §7.6.1 names no framing field hop-by-hop, and the client must get
        // the framing the node follows).
        match classify(n) {
            Name::Hop | Name::Connection | Name::Own => continue,
            Name::TransferEncoding => {
                if te.is_some() {
                    return Err(HeadErr::Invalid);
                }
                te = Some(h.value);
                continue;
            }
            Name::ContentLength => {
                content_length(&mut length, h.value)?;
                continue;
            }
            _ => {}
        }
        if conn.names(n) {
            continue;
        }
        header_line(out, n, h.value);
    }
    let no_body = is_head || status == 204 || status == 304;
    let body = match (te, length) {
        _ if no_body => Framing::None,
        // Codings before chunked: the node would pass on a layer it does not
        // follow; refused (502) rather than guessed.
        (Some(v), _) if chunked_last(v) && !chunked_only(v) => return Err(HeadErr::Invalid),
        // Chunked (or until close) wins over a length, which is not forwarded.
        (Some(v), _) if chunked_last(v) => Framing::Chunked,
        (Some(_), _) => Framing::Close,
        (None, Some(n)) => Framing::Length(n),
        (None, None) => Framing::Close,
    };
    match (body, te, length) {
        (Framing::Chunked, _, _) if chunked_ok => {
            out.extend_from_slice(b"Transfer-Encoding: chunked\r\n")
        }
        // A HEAD's or 304's: what a GET would have had.
        (Framing::None, Some(v), _) if chunked_only(v) => {
            out.extend_from_slice(b"Transfer-Encoding: chunked\r\n")
        }
        (Framing::Length(n), _, _) | (Framing::None, None, Some(n)) => {
            out.extend_from_slice(b"Content-Length: ");
            out.extend_from_slice(itoa(n, &mut [0; 20]));
            out.extend_from_slice(b"\r\n");
        }
        _ => {}
    }
    let keep = if version == 0 {
        conn.keep_alive && !conn.close
    } else {
        !conn.close
    };
    Ok(Some(Response {
        head_len,
        status,
        body,
        // Both a coding and a length: the connection is not trusted with
        // another request (RFC 9112 §6.3).
        reusable: keep && body != Framing::Close && !(te.is_some() && length.is_some()),
    }))
}

/// The length of the complete interim (1xx, not 101) response head at the
/// start of `buf`, if there is one.
pub fn interim(buf: &[u8]) -> Option<usize> {
    let mut hs = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut hs);
    match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => {
            matches!(resp.code, Some(c) if (100..200).contains(&c) && c != 101).then_some(n)
        }
        _ => None,
    }
}

/// The status of the complete response head at the start of `buf` (0 when it
/// is malformed); `None` while it is incomplete.
pub fn head_status(buf: &[u8]) -> Option<u16> {
    let mut hs = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut hs);
    match resp.parse(buf) {
        Ok(httparse::Status::Complete(_)) => Some(resp.code.unwrap_or(0)),
        Ok(httparse::Status::Partial) => None,
        Err(_) => Some(0),
    }
}

/// The decimal digits of `n`.
pub fn itoa(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum CState {
    #[default]
    Size,
    Ext,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    TrailerStart,
    TrailerName,
    TrailerValue,
    TrailerLf,
    EndLf,
    Done,
}

/// What [`Chunked::feed`] makes of the body it follows.
pub enum Emit<'o> {
    /// Nothing: only where the body ends is found.
    #[cfg(test)]
    None,
    /// The chunks' data alone (for an HTTP/1.0 client).
    Data(&'o mut Vec<u8>),
    /// The body written out again, as the node's own: each chunk's size in
    /// hex (extensions left out), its data and CRLF, and `0\r\n\r\n` at the
    /// end (the trailer section left out).
    Chunks(&'o mut Vec<u8>),
}

/// A trailer field name's byte (RFC 9110 §5.6.2 tchar).
fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Follows a chunked body (RFC 9112 §7.1) as its bytes pass, strictly (CRLF
/// line ends only, trailer fields `name: value`), to find where it ends.
#[derive(Default)]
pub struct Chunked {
    state: CState,
    size: u64,
    digits: u8,
    line: usize,
    trailers: usize,
}

impl Chunked {
    pub fn done(&self) -> bool {
        self.state == CState::Done
    }

    /// Takes bytes of `input` until the body's end; returns how many belong to
    /// the body. `Err` for a malformed body (the message cannot be relayed).
    pub fn feed(&mut self, input: &[u8], mut emit: Emit<'_>) -> Result<usize, ()> {
        let mut i = 0;
        while i < input.len() {
            let b = input[i];
            match self.state {
                CState::Size => {
                    let d = match b {
                        b'0'..=b'9' => b - b'0',
                        b'a'..=b'f' => b - b'a' + 10,
                        b'A'..=b'F' => b - b'A' + 10,
                        _ => {
                            if self.digits == 0 {
                                return Err(());
                            }
                            self.state = match b {
                                b'\r' => CState::SizeLf,
                                b';' | b' ' | b'\t' => CState::Ext,
                                _ => return Err(()),
                            };
                            i += 1;
                            continue;
                        }
                    };
                    if self.digits >= 15 {
                        return Err(());
                    }
                    self.size = self.size * 16 + u64::from(d);
                    self.digits += 1;
                    i += 1;
                }
                CState::Ext => {
                    match b {
                        b'\r' => self.state = CState::SizeLf,
                        b'\n' => return Err(()),
                        _ => {
                            self.line += 1;
                            if self.line > MAX_CHUNK_LINE {
                                return Err(());
                            }
                        }
                    }
                    i += 1;
                }
                CState::SizeLf => {
                    if b != b'\n' {
                        return Err(());
                    }
                    i += 1;
                    self.state = if self.size == 0 {
                        CState::TrailerStart
                    } else {
                        if let Emit::Chunks(o) = &mut emit {
                            hex(self.size, o);
                            o.extend_from_slice(b"\r\n");
                        }
                        CState::Data
                    };
                    self.digits = 0;
                    self.line = 0;
                }
                CState::Data => {
                    let n = (self.size.min((input.len() - i) as u64)) as usize;
                    match &mut emit {
                        Emit::Data(o) | Emit::Chunks(o) => o.extend_from_slice(&input[i..i + n]),
                        #[cfg(test)]
                        Emit::None => {}
                    }
                    i += n;
                    self.size -= n as u64;
                    if self.size == 0 {
                        self.state = CState::DataCr;
                    }
                }
                CState::DataCr => {
                    if b != b'\r' {
                        return Err(());
                    }
                    self.state = CState::DataLf;
                    i += 1;
                }
                CState::DataLf => {
                    if b != b'\n' {
                        return Err(());
                    }
                    if let Emit::Chunks(o) = &mut emit {
                        o.extend_from_slice(b"\r\n");
                    }
                    self.state = CState::Size;
                    i += 1;
                }
                CState::TrailerStart => {
                    self.state = match b {
                        b'\r' => CState::EndLf,
                        _ if tchar(b) => CState::TrailerName,
                        // A bare LF, a folded or nameless line: the end of
                        // the message is not where every peer would see it.
                        _ => return Err(()),
                    };
                    i += 1;
                }
                CState::TrailerName => {
                    self.state = match b {
                        b':' => CState::TrailerValue,
                        _ if tchar(b) => CState::TrailerName,
                        _ => return Err(()),
                    };
                    i += 1;
                }
                CState::TrailerValue => {
                    match b {
                        b'\r' => self.state = CState::TrailerLf,
                        b'\t' => {}
                        0..=0x1f | 0x7f => return Err(()),
                        _ => {}
                    }
                    i += 1;
                }
                CState::TrailerLf => {
                    if b != b'\n' {
                        return Err(());
                    }
                    self.state = CState::TrailerStart;
                    i += 1;
                }
                CState::EndLf => {
                    if b != b'\n' {
                        return Err(());
                    }
                    if let Emit::Chunks(o) = &mut emit {
                        o.extend_from_slice(b"0\r\n\r\n");
                    }
                    self.state = CState::Done;
                    return Ok(i + 1);
                }
                CState::Done => return Ok(i),
            }
            if matches!(
                self.state,
                CState::TrailerName | CState::TrailerValue | CState::TrailerLf
            ) {
                self.trailers += 1;
                if self.trailers > MAX_TRAILERS {
                    return Err(());
                }
            }
        }
        Ok(i)
    }
}

/// `n` in lowercase hex digits.
fn hex(n: u64, out: &mut Vec<u8>) {
    let digits = (64 - n.leading_zeros()).div_ceil(4).max(1);
    for k in (0..digits).rev() {
        out.push(b"0123456789abcdef"[((n >> (k * 4)) & 0xf) as usize]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Framing, keep-alive and 100-continue of a parsed request head.
    type Parsed = Result<Option<(Framing, bool, bool)>, HeadErr>;

    fn req(s: &str) -> (Parsed, String) {
        let mut out = Vec::new();
        let r = request(s.as_bytes(), b"192.0.2.1", Some("lbscale_web"), &mut out)
            .map(|o| o.map(|r| (r.body, r.keep_alive, r.expect_continue)));
        (r, String::from_utf8(out).unwrap())
    }

    #[test]
    fn a_request_head_loses_its_hop_by_hop_headers_and_names_the_client() {
        let (r, out) = req(
            "GET http://example.com/a?b HTTP/1.1\r\nHost: example.com\r\n\
             Connection: keep-alive, X-Secret\r\nX-Secret: 1\r\nKeep-Alive: 5\r\nTE: trailers\r\n\
             Upgrade: websocket\r\nX-Forwarded-For: 203.0.113.7\r\nAccept: */*\r\n\
             x-forwarded-for: 198.51.100.2\r\n\r\n",
        );
        assert_eq!(r, Ok(Some((Framing::None, true, false))));
        assert_eq!(
            out,
            "GET /a?b HTTP/1.1\r\nHost: example.com\r\nAccept: */*\r\n\
             X-Forwarded-For: 203.0.113.7, 198.51.100.2, 192.0.2.1\r\n\r\n"
        );
    }

    #[test]
    fn request_framing_and_keep_alive() {
        let (r, out) =
            req("POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nConnection: close\r\n\r\n");
        assert_eq!(r, Ok(Some((Framing::Length(5), false, false))));
        assert!(out.contains("Content-Length: 5\r\n"), "{out}");
        let (r, out) = req(
            "POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\
             Expect: 100-continue\r\n\r\n",
        );
        assert_eq!(r, Ok(Some((Framing::Chunked, true, true))));
        assert!(!out.contains("Expect"), "{out}");
        assert!(out.contains("Transfer-Encoding: chunked\r\n"), "{out}");
        // HTTP/1.0: closes unless it asks to keep alive.
        assert_eq!(
            req("GET / HTTP/1.0\r\n\r\n").0,
            Ok(Some((Framing::None, false, false)))
        );
        assert_eq!(
            req("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").0,
            Ok(Some((Framing::None, true, false)))
        );
        // Incomplete, malformed, ambiguous.
        assert_eq!(req("GET / HTTP/1.1\r\nHost: a\r\n").0, Ok(None));
        assert_eq!(
            req("GET / HTTP/1.1\r\nHost a\r\n\r\n").0,
            Err(HeadErr::Invalid)
        );
        assert_eq!(
            req("POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n").0,
            Err(HeadErr::Invalid)
        );
        assert_eq!(
            req("POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n").0,
            Err(HeadErr::Coding)
        );
        // Chunked alone, nothing else (TE.TE): the node's own field goes out.
        for te in ["identity, chunked", "chunked, chunked", "gzip, chunked"] {
            let h = format!("POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: {te}\r\n\r\n");
            assert_eq!(req(&h).0, Err(HeadErr::Coding), "{te}");
        }
        let (r, out) = req("POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding:  CHUNKED \r\n\r\n");
        assert_eq!(r, Ok(Some((Framing::Chunked, true, false))));
        assert!(out.contains("\r\nTransfer-Encoding: chunked\r\n"), "{out}");
        // Host: exactly one in HTTP/1.1; an absolute target's wins.
        assert_eq!(req("GET / HTTP/1.1\r\n\r\n").0, Err(HeadErr::Invalid));
        assert_eq!(
            req("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n").0,
            Err(HeadErr::Invalid)
        );
        let (_, out) = req("GET http://u@a.example:81/x HTTP/1.1\r\nHost: b\r\n\r\n");
        assert!(
            out.starts_with("GET /x HTTP/1.1\r\nHost: a.example:81\r\n"),
            "{out}"
        );
        assert!(!out.contains("Host: b"), "{out}");
        assert_eq!(
            req("GET http:///x HTTP/1.1\r\nHost: b\r\n\r\n").0,
            Err(HeadErr::Invalid)
        );
        // No 100 Continue to HTTP/1.0; an empty X-Forwarded-For is left out.
        let (r, out) = req(
            "POST / HTTP/1.0\r\nContent-Length: 1\r\nExpect: 100-continue\r\n\
             X-Forwarded-For: \r\n\r\n",
        );
        assert_eq!(r, Ok(Some((Framing::Length(1), false, false))));
        assert!(out.contains("\r\nX-Forwarded-For: 192.0.2.1\r\n"), "{out}");
        assert_eq!(
            req("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n").0,
            Err(HeadErr::Invalid)
        );
        // A coding and a length: refused, whichever comes first.
        for h in [
            "Transfer-Encoding: chunked\r\nContent-Length: 5",
            "Content-Length: 5\r\nTransfer-Encoding: chunked",
        ] {
            assert_eq!(
                req(&format!("POST / HTTP/1.1\r\nHost: t\r\n{h}\r\n\r\n")).0,
                Err(HeadErr::Invalid)
            );
        }
        let many: String = (0..101).map(|i| format!("X-{i}: v\r\n")).collect();
        assert_eq!(
            req(&format!("GET / HTTP/1.1\r\n{many}\r\n")).0,
            Err(HeadErr::TooMany)
        );
    }

    #[test]
    fn the_persistence_cookie_is_found_among_others() {
        let mut out = Vec::new();
        let s = b"GET / HTTP/1.1\r\nHost: t\r\nCookie: a=1; lbscale_web=\"00ff\"; b=2\r\n\r\n";
        let r = request(s, b"192.0.2.1", Some("lbscale_web"), &mut out)
            .unwrap()
            .unwrap();
        assert_eq!(r.cookie, Some("00ff"));
        assert!(String::from_utf8_lossy(&out).contains("Cookie: a=1;"));
        let r = request(s, b"192.0.2.1", None, &mut out).unwrap().unwrap();
        assert_eq!(r.cookie, None);
    }

    fn resp(s: &str, is_head: bool, chunked_ok: bool) -> (Option<(u16, Framing, bool)>, String) {
        let mut out = Vec::new();
        let r = response(s.as_bytes(), is_head, chunked_ok, &mut out)
            .unwrap()
            .map(|r| (r.status, r.body, r.reusable));
        (r, String::from_utf8(out).unwrap())
    }

    #[test]
    fn response_framing_and_reuse() {
        let (r, out) = resp(
            "HTTP/1.1 200 OK\r\nServer: x\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\
             Content-Length: 13\r\n\r\nhello, world\n",
            false,
            true,
        );
        assert_eq!(r, Some((200, Framing::Length(13), true)));
        assert_eq!(
            out,
            "HTTP/1.1 200 OK\r\nServer: x\r\nContent-Length: 13\r\n"
        );
        let (r, out) = resp(
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            false,
            true,
        );
        // Chunked wins over a length; the connection is not reused after.
        assert_eq!(r, Some((200, Framing::Chunked, false)));
        assert_eq!(out, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n");
        // A service's own X-LBSCALE-* headers are not passed on.
        let (_, out) = resp(
            "HTTP/1.1 200 OK\r\nX-LBSCALE-Node: n\r\nx-lbscale-service: s\r\nX-LBSCALE-Other: o\r\n\
             Content-Length: 0\r\n\r\n",
            false,
            true,
        );
        assert_eq!(
            out,
            "HTTP/1.1 200 OK\r\nX-LBSCALE-Other: o\r\nContent-Length: 0\r\n"
        );
        // To an HTTP/1.0 client the chunks are decoded: no Transfer-Encoding.
        let (_, out) = resp(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            false,
            false,
        );
        assert_eq!(out, "HTTP/1.1 200 OK\r\n");
        assert_eq!(
            resp("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", false, true).0,
            Some((200, Framing::Close, false))
        );
        assert_eq!(
            resp("HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n", false, true).0,
            Some((200, Framing::Length(1), false))
        );
        assert_eq!(
            resp(
                "HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n",
                false,
                true
            )
            .0,
            Some((304, Framing::None, true))
        );
        assert_eq!(
            resp("HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", true, true).0,
            Some((200, Framing::None, true))
        );
        assert_eq!(
            resp("HTTP/1.1 100 Continue\r\n\r\n", false, true).0,
            Some((100, Framing::None, true))
        );
        assert_eq!(resp("HTTP/1.1 200 OK\r\n", false, true).0, None);
    }

    #[test]
    fn a_responses_framing_fields_are_the_nodes_own() {
        // `Connection` naming Content-Length removes nothing; the length the
        // node follows is the one written.
        let (r, out) = resp(
            "HTTP/1.1 200 OK\r\nConnection: content-length\r\nContent-Length: 5\r\n\r\n",
            false,
            true,
        );
        assert_eq!(r, Some((200, Framing::Length(5), true)));
        assert_eq!(out, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n");
        for cl in ["2, 2", "02", "2\r\nContent-Length: 2"] {
            let (_, out) = resp(
                &format!("HTTP/1.1 200 OK\r\nContent-Length: {cl}\r\n\r\n"),
                false,
                true,
            );
            assert_eq!(out, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n", "{cl}");
        }
        let (r, out) = resp(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n",
            false,
            true,
        );
        assert_eq!(r, Some((200, Framing::Chunked, true)));
        assert_eq!(out, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n");
        let mut out = Vec::new();
        for te in ["chunked, chunked", "gzip, chunked"] {
            let h = format!("HTTP/1.1 200 OK\r\nTransfer-Encoding: {te}\r\n\r\n");
            assert!(
                response(h.as_bytes(), false, true, &mut out).is_err(),
                "{te}"
            );
        }
    }

    #[test]
    fn chunked_bodies_end_where_they_end_in_any_pieces() {
        let body =
            b"5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nTrailer: x\r\n\r\nNEXT";
        let end = body.len() - 4;
        for split in 0..body.len() {
            let mut c = Chunked::default();
            let mut data = Vec::new();
            let a = c.feed(&body[..split], Emit::Data(&mut data)).unwrap();
            assert_eq!(a, split.min(end));
            let b = c.feed(&body[a..], Emit::Data(&mut data)).unwrap();
            assert_eq!(a + b, end, "split at {split}");
            assert!(c.done());
            assert_eq!(data, b"helloabcdefghijklmnopqrstuvwxyz");
            // Written out again: extensions and trailers left out.
            let mut c = Chunked::default();
            let mut out = Vec::new();
            let a = c.feed(&body[..split], Emit::Chunks(&mut out)).unwrap();
            c.feed(&body[a..], Emit::Chunks(&mut out)).unwrap();
            assert_eq!(
                String::from_utf8_lossy(&out),
                "5\r\nhello\r\n1a\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\n\r\n"
            );
        }
        assert!(Chunked::default().feed(b"x\r\n", Emit::None).is_err());
        assert!(Chunked::default().feed(b"5\r\nhelloX", Emit::None).is_err());
        assert!(Chunked::default()
            .feed(b"ffffffffffffffff\r\n", Emit::None)
            .is_err());
    }

    #[test]
    fn malformed_trailer_sections_are_refused() {
        for bad in [
            &b"0\r\nX: y\n\r\n"[..],                        // bare LF ending a field
            b"0\r\nX: y\n\nGET /smuggled HTTP/1.1\r\n\r\n", // a request hidden behind one
            b"0\r\nno colon\r\n\r\n",
            b"0\r\n: nameless\r\n\r\n",
            b"0\r\n folded: x\r\n\r\n",
            b"0\r\nX: a\rb\r\n\r\n",
            b"0\r\n\n",
            b"3\r\nabc\n0\r\n\r\n",
            b"3\nabc\r\n0\r\n\r\n",
        ] {
            let r = Chunked::default().feed(bad, Emit::None);
            assert!(r.is_err(), "{:?} taken", String::from_utf8_lossy(bad));
        }
        let long = format!("0\r\nX: {}\r\n\r\n", "v".repeat(MAX_TRAILERS));
        assert!(Chunked::default()
            .feed(long.as_bytes(), Emit::None)
            .is_err());
        let mut c = Chunked::default();
        assert_eq!(c.feed(b"0\r\nA: 1\r\nB-c:\t2 \r\n\r\n", Emit::None), Ok(20));
        assert!(c.done());
    }

    #[test]
    fn absolute_targets_become_origin_form() {
        let o = |t: &str| {
            let mut out = Vec::new();
            origin_form(t, &mut out).unwrap();
            String::from_utf8(out).unwrap()
        };
        assert_eq!(o("http://h/a?b"), "/a?b");
        assert_eq!(o("http://h"), "/");
        assert_eq!(o("https://h?q"), "/?q");
        assert_eq!(o("/x"), "/x");
        assert_eq!(o("*"), "*");
    }
}
