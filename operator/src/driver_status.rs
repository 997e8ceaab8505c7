//! What a job's driver reports on `GET /status`, and a minimal HTTP/1.0 client to ask for it.
//!
//! The reconciler reads it for the rendezvous round and the blacklist: worker pods whose host the
//! driver blacklisted are deleted and replaced.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
    let io = |source| StatusError::Io { addr, source };
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await.map_err(io)?;
        let request =
            format!("GET /status HTTP/1.0\r\nHost: {addr}\r\nAccept: application/json\r\n\r\n");
        stream.write_all(request.as_bytes()).await.map_err(io)?;
        let mut body = Vec::new();
        let mut limited = (&mut stream).take(MAX_RESPONSE_BYTES as u64 + 1);
        limited.read_to_end(&mut body).await.map_err(io)?;
        Ok(body)
    };
    let bytes = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| StatusError::Timeout { addr, timeout })??;
    if bytes.len() > MAX_RESPONSE_BYTES {
        return Err(StatusError::Bad {
            addr,
            reason: format!("response larger than {MAX_RESPONSE_BYTES} bytes"),
        });
    }
    parse_response(&bytes).map_err(|reason| StatusError::Bad { addr, reason })
}

/// Parses a whole HTTP/1.x response carrying a status JSON body.
///
/// # Errors
/// A message naming the problem: no header end, a non-200 status line, a chunked body, bad JSON.
pub fn parse_response(bytes: &[u8]) -> Result<DriverStatus, String> {
    let split = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("the response has no end of headers")?;
    let head = String::from_utf8_lossy(&bytes[..split]);
    let body = &bytes[split + 4..];
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default();
    let code = status_line.split_whitespace().nth(1).unwrap_or_default();
    if !status_line.starts_with("HTTP/1.") || code != "200" {
        return Err(format!("unexpected status line '{status_line}'"));
    }
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    if chunked {
        return Err("chunked bodies are not supported".into());
    }
    serde_json::from_slice(body).map_err(|e| format!("bad status JSON: {e}"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    const BODY: &str = r#"{"phase":"Running","generation":3,"workers":4,
        "hosts":[{"host":"10.0.0.1","slots":2}],
        "blacklisted":[{"host":"10.0.0.9","until_ms":1234}],"resets":1}"#;

    #[test]
    fn parses_a_200_with_json() {
        let resp = format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{BODY}");
        let st = parse_response(resp.as_bytes()).unwrap();
        assert_eq!(st.generation, 3);
        assert_eq!(st.hosts[0].slots, 2);
        assert_eq!(st.blacklisted[0].host, "10.0.0.9");
        assert_eq!(st.blacklisted[0].until_ms, Some(1234));
        assert_eq!(st.resets, 1);
    }

    #[test]
    fn refuses_errors_chunks_and_garbage() {
        let e = parse_response(b"HTTP/1.1 401 Unauthorized\r\n\r\n").unwrap_err();
        assert!(e.contains("401"), "{e}");
        let e = parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n")
            .unwrap_err();
        assert!(e.contains("chunked"), "{e}");
        let e = parse_response(b"HTTP/1.1 200 OK\r\n\r\n{nope").unwrap_err();
        assert!(e.contains("bad status JSON"), "{e}");
        assert!(parse_response(b"HTTP/1.1 200 OK").is_err());
    }

    #[tokio::test]
    async fn fetches_over_tcp() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = vec![0u8; 1024];
            let n = s.read(&mut req).await.unwrap();
            let req = String::from_utf8_lossy(&req[..n]).to_string();
            let resp = format!("HTTP/1.0 200 OK\r\n\r\n{BODY}");
            s.write_all(resp.as_bytes()).await.unwrap();
            req
        });
        let st = fetch(addr, Duration::from_secs(5)).await.unwrap();
        assert_eq!(st.workers, 4);
        assert!(
            server
                .await
                .unwrap()
                .starts_with("GET /status HTTP/1.0\r\n")
        );
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
