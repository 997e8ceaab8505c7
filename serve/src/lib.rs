//! A minimal HTTP/1.1 server for GET endpoints: one request per connection, answered and
//! closed. The driver serves its `/status` with it and the operator its health probes; both
//! are polled by machines (the operator, the kubelet), so nothing more of HTTP is needed.
//!
//! Requests that are not `GET` get `405` with `Allow: GET`, lines that are not HTTP/1.x get
//! `400`; both bodies are JSON (`{"error": ...}`). Every other answer is the handler's.
//! [`bind_any`] opens a listener on every interface, IPv6 and IPv4 alike.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Longest request head read.
const MAX_HEAD: usize = 8 * 1024;
/// How long a client has to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    /// `GET` of this path (the query string dropped).
    Get(String),
    /// Another method.
    NotAllowed(String),
    /// Not an HTTP/1.x request line.
    Bad,
}

/// An answer: status line (`"200 OK"`), content type and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code and reason, as on the status line.
    pub status: &'static str,
    /// The `Content-Type` header's value.
    pub content_type: &'static str,
    /// The body.
    pub body: String,
}

impl Response {
    /// A JSON document with `status`.
    pub fn json(status: &'static str, body: String) -> Self {
        Self {
            status,
            content_type: "application/json",
            body,
        }
    }

    /// A plain-text answer with `status`.
    pub fn text(status: &'static str, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }

    /// A JSON error document `{"error": why}`, escaped whatever `why` holds.
    pub fn error(status: &'static str, why: &str) -> Self {
        Self::json(status, serde_json::json!({ "error": why }).to_string())
    }
}

/// Binds `port` on every interface for `what` (a rendezvous, a status or probe endpoint): `[::]`,
/// taking IPv4 clients too, or `0.0.0.0` (with a warning) where the host has no IPv6.
pub async fn bind_any(port: u16, what: &str) -> std::io::Result<tokio::net::TcpListener> {
    use std::io::ErrorKind;
    match bind_dual_stack(port) {
        Ok(l) => Ok(l),
        // Not an IPv6 problem: IPv4 would fail the same way.
        Err(e) if matches!(e.kind(), ErrorKind::AddrInUse | ErrorKind::PermissionDenied) => Err(e),
        Err(e) => {
            tracing::warn!(
                port,
                error = %e,
                "cannot listen on [::]; the {what} serves IPv4 only"
            );
            tokio::net::TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, port)).await
        }
    }
}

/// A listener on `[::]:port` that also accepts IPv4 (mapped) connections.
fn bind_dual_stack(port: u16) -> std::io::Result<tokio::net::TcpListener> {
    use nix::sys::socket::{setsockopt, sockopt};
    let sock = tokio::net::TcpSocket::new_v6()?;
    setsockopt(&sock, sockopt::Ipv6V6Only, &false).map_err(std::io::Error::from)?;
    sock.set_reuseaddr(true)?;
    sock.bind((std::net::Ipv6Addr::UNSPECIFIED, port).into())?;
    sock.listen(1024)
}

/// Parses the request line of `head`.
pub fn parse(head: &[u8]) -> Request {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Request::Bad;
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Request::Bad;
    }
    if method != "GET" {
        return Request::NotAllowed(method.to_string());
    }
    Request::Get(target.split('?').next().unwrap_or(target).to_string())
}

/// The response to `req`, with any extra header lines: the handler's for a GET, an error
/// otherwise.
pub fn respond(req: Request, handler: &dyn Fn(&str) -> Response) -> (Response, &'static str) {
    match req {
        Request::Get(path) => (handler(&path), ""),
        Request::NotAllowed(m) => (
            Response::error(
                "405 Method Not Allowed",
                &format!("method {m} not allowed; use GET"),
            ),
            "Allow: GET\r\n",
        ),
        Request::Bad => (
            Response::error("400 Bad Request", "not an HTTP/1.x request"),
            "",
        ),
    }
}

/// Answers every connection on `listener` with `handler` (given the request's path), until the
/// task is aborted. `what` names the endpoint in logs.
pub async fn serve<H>(listener: TcpListener, what: &'static str, handler: H)
where
    H: Fn(&str) -> Response + Send + Sync + 'static,
{
    let handler = Arc::new(handler);
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let handler = Arc::clone(&handler);
                tokio::spawn(async move {
                    if let Err(e) = answer(stream, handler.as_ref()).await {
                        tracing::debug!(%peer, error = %e, "{what}: request failed");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "{what}: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn answer<H>(mut stream: TcpStream, handler: &H) -> std::io::Result<()>
where
    H: Fn(&str) -> Response + Sync,
{
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    let read = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    tokio::time::timeout(READ_TIMEOUT, read)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no request in time"))??;
    let (r, extra) = respond(parse(&head), handler);
    let response = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n{}",
        r.status,
        r.content_type,
        r.body.len(),
        r.body
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_are_parsed() {
        assert_eq!(
            parse(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n"),
            Request::Get("/status".into())
        );
        assert_eq!(
            parse(b"GET /status?x=1 HTTP/1.0\r\n\r\n"),
            Request::Get("/status".into())
        );
        assert_eq!(
            parse(b"POST /status HTTP/1.1\r\n\r\n"),
            Request::NotAllowed("POST".into())
        );
        assert_eq!(parse(b"hello\r\n\r\n"), Request::Bad);
        assert_eq!(parse(b"GET /status SMTP\r\n\r\n"), Request::Bad);
        assert_eq!(parse(b"GET status HTTP/1.1\r\n\r\n"), Request::Bad);
    }

    #[test]
    fn errors_are_json_whatever_the_method() {
        let ok = |_: &str| Response::text("200 OK", "ok");
        let (r, extra) = respond(parse("PÖST\u{1} / HTTP/1.1\r\n\r\n".as_bytes()), &ok);
        assert_eq!(
            (r.status, extra),
            ("405 Method Not Allowed", "Allow: GET\r\n")
        );
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["error"], "method P\u{d6}ST\u{1} not allowed; use GET");
        let (r, _) = respond(Request::Bad, &ok);
        assert_eq!(r.status, "400 Bad Request");
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["error"], "not an HTTP/1.x request");
        let e = Response::error("404 Not Found", "no \"such\"\\ path");
        let v: serde_json::Value = serde_json::from_str(&e.body).unwrap();
        assert_eq!(v["error"], "no \"such\"\\ path");
    }

    async fn get(port: u16, request: &str) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    /// Whether this host can use IPv6 loopback at all.
    fn has_ipv6() -> bool {
        std::net::TcpListener::bind("[::1]:0").is_ok()
    }

    #[tokio::test]
    async fn bind_any_takes_ipv4_and_ipv6_clients() {
        let listener = bind_any(0, "status endpoint").await.unwrap();
        let addr = listener.local_addr().unwrap();
        assert!(addr.ip().is_unspecified(), "{addr}");
        let port = addr.port();
        let accepts = tokio::spawn(async move {
            for _ in 0..2 {
                listener.accept().await.unwrap();
            }
        });
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        if has_ipv6() {
            assert!(addr.is_ipv6(), "IPv6 is available but {addr} is IPv4 only");
            tokio::net::TcpStream::connect(("::1", port)).await.unwrap();
        } else {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
        }
        tokio::time::timeout(Duration::from_secs(5), accepts)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_port_in_use_is_an_error_not_a_fallback() {
        let first = bind_any(0, "status endpoint").await.unwrap();
        let port = first.local_addr().unwrap().port();
        let err = bind_any(port, "status endpoint").await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");
    }

    /// Edits of a request head: cut, flip, insert bytes, repeat a span, insert invalid UTF-8.
    fn mutate(mut head: Vec<u8>, edits: &[(u8, usize, u8, Vec<u8>)]) -> Vec<u8> {
        for (kind, at, byte, bytes) in edits {
            let at = at % (head.len() + 1);
            match kind {
                0 => head.truncate(at),
                1 if at < head.len() => head[at] ^= (*byte).max(1),
                2 => drop(head.splice(at..at, bytes.iter().copied())),
                3 => {
                    let span = head[at..(at + usize::from(*byte)).min(head.len())].to_vec();
                    head.splice(at..at, span);
                }
                _ => drop(head.splice(at..at, [0xff, 0xc0, b' ', b'\r', b'\n'])),
            }
        }
        head
    }

    /// What any head may parse to: a GET of one path without query, spaces or line breaks; a
    /// method other than GET; or a bad request. The answer to a refusal is a JSON error.
    fn check(head: &[u8]) -> Result<(), proptest::test_runner::TestCaseError> {
        use proptest::prelude::*;
        let first = head.split(|&b| b == b'\n').next().unwrap_or_default();
        match parse(head) {
            Request::Get(path) => {
                prop_assert!(path.starts_with('/'), "{path:?}");
                prop_assert!(!path.contains([' ', '?', '\n']), "{path:?}");
                prop_assert!(path.len() <= first.len() * 3, "{path:?} from {first:?}");
            }
            Request::NotAllowed(m) => {
                prop_assert!(m != "GET" && !m.contains([' ', '\n']), "{m:?}");
                let (r, extra) = respond(Request::NotAllowed(m.clone()), &|_| unreachable!());
                prop_assert_eq!(
                    (r.status, extra),
                    ("405 Method Not Allowed", "Allow: GET\r\n")
                );
                let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
                prop_assert_eq!(
                    v["error"].as_str().unwrap(),
                    format!("method {m} not allowed; use GET")
                );
            }
            Request::Bad => {
                let (r, _) = respond(Request::Bad, &|_| unreachable!());
                prop_assert_eq!(r.status, "400 Bad Request");
                prop_assert!(r.body.contains("not an HTTP/1.x request"));
            }
        }
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(1000))]

        /// Random heads, raw bytes and invalid UTF-8 included.
        #[test]
        fn random_heads_parse_to_a_request_or_bad(head in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            check(&head)?;
        }

        /// Real requests edited in transit.
        #[test]
        fn mutated_requests_parse_to_a_request_or_bad(
            method in "GET|POST|DELETE|get|G\\x00T",
            path in "/[a-z/?=&%]{0,40}",
            edits in proptest::collection::vec(
                (0u8..5, proptest::prelude::any::<usize>(), proptest::prelude::any::<u8>(),
                 proptest::collection::vec(proptest::prelude::any::<u8>(), 0..8)),
                0..4,
            ),
        ) {
            let head = format!("{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n").into_bytes();
            check(&mutate(head, &edits))?;
        }
    }

    /// Reads one answer; `None` when the server closed without one.
    async fn answer_to(port: u16, request: &[u8]) -> Option<String> {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        // The server may answer and close before it read everything; that is its right.
        let _ = s.write_all(request).await;
        let _ = s.shutdown().await;
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
            .await
            .expect("the server answers or closes")
            .ok()?;
        Some(String::from_utf8_lossy(&out).into_owned())
    }

    /// Hostile clients over TCP: random bytes, a head that never ends, one far past the limit.
    /// Each gets a 400, a 405 or the handler's answer, or a closed connection; none hangs the
    /// server, and a real request after them is answered.
    #[tokio::test]
    async fn hostile_requests_over_tcp_leave_the_server_serving() {
        use proptest::strategy::{Strategy, ValueTree};
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(serve(listener, "test endpoint", |_: &str| {
            Response::text("200 OK", "ok")
        }));
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let junk = proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2048);
        let mut requests: Vec<Vec<u8>> = (0..64)
            .map(|_| junk.new_tree(&mut runner).unwrap().current())
            .collect();
        // Exactly the head limit with no end of head: read whole, then refused.
        requests.push(vec![b'A'; MAX_HEAD]);
        // Past the limit: the server stops reading at the limit and answers or closes.
        requests.push(vec![b'B'; MAX_HEAD * 8]);
        for request in &requests {
            if let Some(out) = answer_to(port, request).await {
                assert!(
                    out.is_empty()
                        || out.starts_with("HTTP/1.1 400 Bad Request\r\n")
                        || out.starts_with("HTTP/1.1 405 Method Not Allowed\r\n")
                        || out.starts_with("HTTP/1.1 200 OK\r\n"),
                    "{out}"
                );
            }
        }
        let limit = answer_to(port, &vec![b'A'; MAX_HEAD]).await.unwrap();
        assert!(limit.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{limit}");
        let ok = answer_to(port, b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        assert!(ok.ends_with("\r\n\r\nok"), "{ok}");
        server.abort();
    }

    /// Real connections: the handler's answer with its headers, and a method refused.
    #[tokio::test]
    async fn serves_requests_over_tcp() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(serve(listener, "test endpoint", |path: &str| {
            Response::text("200 OK", format!("you asked for {path}"))
        }));
        let ok = get(port, "GET /healthz?verbose HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains("Content-Type: text/plain; charset=utf-8\r\n"),
            "{ok}"
        );
        assert!(ok.contains("Content-Length: 22\r\n"), "{ok}");
        assert!(ok.ends_with("\r\n\r\nyou asked for /healthz"), "{ok}");
        let refused = get(port, "DELETE / HTTP/1.1\r\n\r\n").await;
        assert!(
            refused.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"),
            "{refused}"
        );
        assert!(refused.contains("Allow: GET\r\n"), "{refused}");
        server.abort();
    }
}
