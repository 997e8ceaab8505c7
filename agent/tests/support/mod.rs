//! An agent served in process on a free loopback port, for the tests.

use hvd_agent::{Limits, serve_with_limits};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// An agent with `secret` and `limits`, serving on a free port until the returned sender is
/// dropped; returns its address too.
pub async fn agent_with(secret: &str, limits: Limits) -> (String, oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(serve_with_limits(
        listener,
        secret.into(),
        limits,
        async move {
            let _ = rx.await;
        },
    ));
    (addr, tx)
}
