//! The HTTP plumbing the driver's API and the operator's probes share: a listener on every
//! interface ([`bind_any`], IPv6 and IPv4 alike), serving an axum [`Router`] until a shutdown
//! future resolves ([`serve`]), JSON error answers ([`error`], [`not_found`]) and the
//! Prometheus exposition of a metrics registry ([`metrics`]), and the body of the driver's
//! `GET /status` that the operator reads ([`status`]).
//!
//! Routers are built by the crates that own the endpoints (`status::router`,
//! `probes::router`) and tested there without sockets; this crate only runs them.

use std::future::Future;

pub use axum::Router;
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use tokio::net::TcpListener;

pub mod metrics;
pub mod status;

/// Binds `port` on every interface for `what` (a rendezvous, a status or probe endpoint): `[::]`,
/// taking IPv4 clients too, or `0.0.0.0` (with a warning) where the host has no IPv6.
///
/// # Errors
/// The port is taken, or binding is not allowed.
pub async fn bind_any(port: u16, what: &str) -> std::io::Result<TcpListener> {
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
            TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, port)).await
        }
    }
}

/// A listener on `[::]:port` that also accepts IPv4 (mapped) connections.
fn bind_dual_stack(port: u16) -> std::io::Result<TcpListener> {
    use nix::sys::socket::{setsockopt, sockopt};
    let sock = tokio::net::TcpSocket::new_v6()?;
    setsockopt(&sock, sockopt::Ipv6V6Only, &false).map_err(std::io::Error::from)?;
    sock.set_reuseaddr(true)?;
    sock.bind((std::net::Ipv6Addr::UNSPECIFIED, port).into())?;
    sock.listen(1024)
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets the requests in flight
/// finish (they are all short: every handler answers from memory).
///
/// Every answer closes its connection: the clients (the operator, the kubelet, Prometheus)
/// poll once per interval, and simple ones read an answer to its end.
///
/// # Errors
/// Only from the listener itself; a failed connection is the client's business.
pub async fn serve<F>(listener: TcpListener, router: Router, shutdown: F) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let router = router.layer(axum::middleware::map_response(close));
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn close(mut r: Response) -> Response {
    r.headers_mut().insert(
        header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    r
}

/// A JSON error document `{"error": why}` with `status`, escaped whatever `why` holds.
pub fn error(status: StatusCode, why: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::json!({ "error": why }).to_string(),
    )
        .into_response()
}

/// A router's fallback: `404` naming the path asked for and the `paths` there are (as in
/// `"/status or /metrics"`).
pub fn not_found(paths: &'static str) -> impl Fn(Uri) -> std::future::Ready<Response> + Clone {
    move |uri: Uri| {
        std::future::ready(error(
            StatusCode::NOT_FOUND,
            &format!("no such path: {}; try {paths}", uri.path()),
        ))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::time::Duration;

    use axum::body::Body;
    use axum::http::{Method, Request};
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tower::ServiceExt;

    use super::*;

    fn app() -> Router {
        Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .fallback(not_found("/healthz"))
    }

    async fn body(r: Response) -> String {
        let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn unknown_paths_are_json_404s_naming_them_and_other_methods_405s() {
        let r = app()
            .oneshot(Request::get("/caf%C3%A9\"").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
        let v: serde_json::Value = serde_json::from_str(&body(r).await).unwrap();
        assert_eq!(v["error"], "no such path: /caf%C3%A9\"; try /healthz");
        let r = app()
            .oneshot(
                Request::builder()
                    .method(Method::DELETE)
                    .uri("/healthz")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
        let allow = r.headers()[header::ALLOW].to_str().unwrap();
        assert!(allow.contains("GET"), "{allow}");
    }

    #[test]
    fn errors_are_json_whatever_they_hold() {
        let e = error(StatusCode::BAD_REQUEST, "no \"such\"\\ path\n");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&rt.block_on(body(e))).unwrap();
        assert_eq!(v["error"], "no \"such\"\\ path\n");
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

    /// Reads the whole answer to one raw request.
    async fn exchange(port: u16, request: &[u8]) -> String {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        s.write_all(request).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
            .await
            .expect("the server answers and closes")
            .unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Over a real socket: an answer, a 404, a request that is not HTTP, and a graceful stop
    /// once the shutdown future resolves.
    #[tokio::test]
    async fn serves_over_tcp_until_shut_down() {
        let listener = bind_any(0, "test endpoint").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, app(), async {
            let _ = stopped.await;
        }));
        let ok = exchange(
            port,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.ends_with("\r\n\r\nok"), "{ok}");
        // Closed after the answer, though the client did not ask.
        let missing = exchange(port, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(
            missing.starts_with("HTTP/1.1 404 Not Found\r\n"),
            "{missing}"
        );
        let junk = exchange(port, b"\x00\xffhello\r\n\r\n").await;
        assert!(
            junk.is_empty() || junk.starts_with("HTTP/1.1 400"),
            "{junk}"
        );
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("the server stops on shutdown")
            .unwrap()
            .unwrap();
    }
}
