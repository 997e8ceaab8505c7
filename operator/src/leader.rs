//! Leader election: only the holder of a coordination.k8s.io Lease reconciles.
//!
//! The Lease itself is kept by `kube-lease-manager`, which publishes "I hold it" on a watch
//! channel; [`while_leader`] turns that channel into "run the controller while leading, stop when
//! the lease is lost".

use std::future::Future;

use tokio::sync::watch;

/// How [`while_leader`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leadership {
    /// The work finished (a shutdown) while this instance led.
    WorkEnded,
    /// Another instance took the lease: the work was stopped.
    Lost,
    /// The lease manager stopped before this instance led.
    ElectionEnded,
}

/// Waits until `leader` is true, then runs `work` until it ends or `leader` turns false.
///
/// After [`Leadership::Lost`] the caller should exit: the work was dropped mid-flight, and a
/// fresh process is the simplest way back to a clean state.
pub async fn while_leader<F: Future<Output = ()>>(
    mut leader: watch::Receiver<bool>,
    work: F,
) -> Leadership {
    if leader.wait_for(|held| *held).await.is_err() {
        return Leadership::ElectionEnded;
    }
    tracing::info!("leading: the lease is held");
    tokio::select! {
        () = work => Leadership::WorkEnded,
        lost = leader.wait_for(|held| !*held) => {
            match lost {
                Ok(_) => tracing::warn!("the lease was lost"),
                Err(_) => tracing::warn!("the lease manager stopped"),
            }
            Leadership::Lost
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn work_starts_only_once_leading() {
        let (tx, rx) = watch::channel(false);
        let started = Arc::new(AtomicBool::new(false));
        let s = started.clone();
        let task = tokio::spawn(while_leader(rx, async move {
            s.store(true, Ordering::SeqCst);
        }));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !started.load(Ordering::SeqCst),
            "work ran without the lease"
        );
        tx.send(true).unwrap();
        let end = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(end, Leadership::WorkEnded);
        assert!(started.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn losing_the_lease_stops_the_work() {
        let (tx, rx) = watch::channel(true);
        let task = tokio::spawn(while_leader(rx, std::future::pending::<()>()));
        tokio::time::sleep(Duration::from_millis(20)).await;
        tx.send(false).unwrap();
        let end = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(end, Leadership::Lost);
    }

    #[tokio::test]
    async fn a_stopped_election_never_starts_the_work() {
        let (tx, rx) = watch::channel(false);
        drop(tx);
        let end = while_leader(rx, async { panic!("must not run") }).await;
        assert_eq!(end, Leadership::ElectionEnded);
    }
}
