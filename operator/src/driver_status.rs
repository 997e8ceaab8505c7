//! What a job's driver reports on `GET /status` (the contract in `hvd_serve::status`), asked
//! for over HTTP/1.1 with hyper's client connection.
//!
//! The reconciler reads it for the rendezvous round and the blacklist: worker pods whose host the
//! driver blacklisted are deleted and replaced.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;

/// The largest status response read; a bigger one is refused.
pub const MAX_RESPONSE_BYTES: usize = 4 << 20;

pub use hvd_serve::status::{BlacklistedHost, DriverPhase, DriverStatus, StatusHost};

/// Why the driver's status could not be read.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// Connecting, writing or reading failed.
    #[error("driver status at {addr}: {source}")]
    Io {
        /// The driver's status address.
        addr: SocketAddr,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// No complete answer within the timeout.
    #[error("driver status at {addr}: no answer within {timeout:?}")]
    Timeout {
        /// The driver's status address.
        addr: SocketAddr,
        /// How long it waited.
        timeout: Duration,
    },
    /// The answer is not a 200 response with a status JSON body.
    #[error("driver status at {addr}: {reason}")]
    Bad {
        /// The driver's status address.
        addr: SocketAddr,
        /// What is wrong with the answer.
        reason: String,
    },
}

/// Asks the driver at `addr` for `GET /status`, giving up after `timeout`.
///
/// # Errors
/// [`StatusError`] naming the address when the driver cannot be reached, is slow, or answers
/// something other than a 200 with a status JSON body.
pub async fn fetch(addr: SocketAddr, timeout: Duration) -> Result<DriverStatus, StatusError> {
    tokio::time::timeout(timeout, exchange(addr))
        .await
        .map_err(|_| StatusError::Timeout { addr, timeout })?
}

/// One `GET /status` over HTTP/1.1 (hyper's client connection), its body read up to
/// [`MAX_RESPONSE_BYTES`].
async fn exchange(addr: SocketAddr) -> Result<DriverStatus, StatusError> {
    use http_body_util::{BodyExt, Empty, Limited};
    use hyper::body::Bytes;
    use hyper::header::{ACCEPT, HOST};
    let io = |source| StatusError::Io { addr, source };
    let bad = |reason: String| StatusError::Bad { addr, reason };
    let stream = TcpStream::connect(addr).await.map_err(io)?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| bad(format!("HTTP handshake: {e}")))?;
    // The connection runs beside the request until the answer is read, then ends with it.
    let connection = tokio::spawn(connection);
    let answer = async {
        let request = hyper::Request::get("/status")
            .header(HOST, addr.to_string())
            .header(ACCEPT, "application/json")
            .body(Empty::<Bytes>::new())
            .map_err(|e| bad(format!("the request: {e}")))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| bad(format!("no answer: {e}")))?;
        if response.status() != hyper::StatusCode::OK {
            return Err(bad(format!("answered {}", response.status())));
        }
        let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|e| {
                bad(format!(
                    "reading the body (at most {MAX_RESPONSE_BYTES} bytes): {e}"
                ))
            })?
            .to_bytes();
        serde_json::from_slice(&body).map_err(|e| bad(format!("bad status JSON: {e}")))
    };
    let status = answer.await;
    connection.abort();
    status
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    const BODY: &str = r#"{"phase":"Running","generation":3,"workers":4,
        "hosts":[{"host":"10.0.0.1","slots":2}],
        "blacklisted":[{"host":"10.0.0.9","until_ms":1234}],"resets":1}"#;

    /// A driver that answers every connection with `response`; returns its address and the
    /// first request it read.
    async fn driver(response: Vec<u8>) -> (SocketAddr, tokio::task::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = vec![0u8; 1024];
            let n = s.read(&mut req).await.unwrap();
            s.write_all(&response).await.unwrap();
            String::from_utf8_lossy(&req[..n]).to_string()
        });
        (addr, server)
    }

    #[tokio::test]
    async fn fetches_over_tcp() {
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{BODY}",
            BODY.len()
        );
        let (addr, server) = driver(resp.into_bytes()).await;
        let st = fetch(addr, Duration::from_secs(5)).await.unwrap();
        assert_eq!(st.workers, 4);
        assert_eq!(st.generation, 3);
        assert_eq!(st.hosts[0].slots, 2);
        assert_eq!(st.blacklisted[0].host, "10.0.0.9");
        assert_eq!(st.blacklisted[0].until_ms, Some(1234));
        assert_eq!(st.resets, 1);
        let req = server.await.unwrap();
        assert!(req.starts_with("GET /status HTTP/1.1\r\n"), "{req}");
    }

    #[tokio::test]
    async fn reads_close_delimited_and_chunked_bodies() {
        let (addr, _) = driver(format!("HTTP/1.0 200 OK\r\n\r\n{BODY}").into_bytes()).await;
        assert_eq!(
            fetch(addr, Duration::from_secs(5)).await.unwrap().workers,
            4
        );
        let chunked = format!(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{BODY}\r\n0\r\n\r\n",
            BODY.len()
        );
        let (addr, _) = driver(chunked.into_bytes()).await;
        assert_eq!(fetch(addr, Duration::from_secs(5)).await.unwrap().resets, 1);
    }

    #[tokio::test]
    async fn refuses_errors_garbage_and_oversized_answers() {
        let bad = |e: StatusError| match e {
            StatusError::Bad { reason, .. } => reason,
            other => panic!("{other}"),
        };
        let (addr, _) =
            driver(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n".to_vec()).await;
        let e = bad(fetch(addr, Duration::from_secs(5)).await.unwrap_err());
        assert!(e.contains("401"), "{e}");
        let (addr, _) = driver(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n{nope".to_vec()).await;
        let e = bad(fetch(addr, Duration::from_secs(5)).await.unwrap_err());
        assert!(e.contains("bad status JSON"), "{e}");
        let (addr, _) = driver(b"not http at all\r\n\r\n".to_vec()).await;
        bad(fetch(addr, Duration::from_secs(5)).await.unwrap_err());
        let mut huge = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
            MAX_RESPONSE_BYTES + 1
        )
        .into_bytes();
        huge.resize(huge.len() + MAX_RESPONSE_BYTES + 1, b' ');
        let (addr, _) = driver(huge).await;
        let e = bad(fetch(addr, Duration::from_secs(5)).await.unwrap_err());
        assert!(e.contains("at most"), "{e}");
    }

    #[tokio::test]
    async fn silent_driver_times_out_and_closed_port_is_an_io_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Accepts (the kernel does) but never answers.
        let err = fetch(addr, Duration::from_millis(200)).await.unwrap_err();
        assert!(matches!(err, StatusError::Timeout { .. }), "{err}");
        drop(listener);
        let err = fetch(addr, Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(err, StatusError::Io { .. }), "{err}");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    }
}
