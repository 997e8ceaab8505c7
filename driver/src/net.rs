//! Listeners on every interface, IPv6 and IPv4 alike.

/// Binds `port` on every interface for `what` (the rendezvous, the status endpoint): `[::]`,
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Whether this host can use IPv6 loopback at all.
    fn has_ipv6() -> bool {
        std::net::TcpListener::bind("[::1]:0").is_ok()
    }

    #[tokio::test]
    async fn the_status_listener_takes_ipv4_and_ipv6_clients() {
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
}
