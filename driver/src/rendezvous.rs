//! The driver's side of the rendezvous: workers connect, present the job secret and their
//! listener address, and keep the connection open. The driver answers rounds with rank tables
//! and pushes host changes down it; a worker notices at once when its driver is gone, and the
//! driver notices at once when a worker's connection drops. The driver also pings every worker
//! on it: a process that stops answering is frozen, although its connection stays open.

use std::time::Duration;

use hvd_rendezvous::{DriverMsg, MAX_LINE, WorkerMsg, decode_line, encode_line};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const FIRST_LINE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often registered workers are pinged: often enough that a live one is never near the
/// heartbeat timeout.
pub fn ping_period(heartbeat_timeout: Duration) -> Duration {
    (heartbeat_timeout / 4).max(Duration::from_millis(10))
}

/// A worker that presented the right secret.
#[derive(Debug)]
pub struct Registration {
    /// Its id (the rank, in a static job).
    pub worker: u64,
    /// Its collective listener.
    pub addr: String,
    /// Its host.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// Messages queued here are written to the worker in order; dropping it closes the
    /// connection.
    pub tx: mpsc::UnboundedSender<Vec<u8>>,
}

impl Registration {
    /// Queues `msg` for the worker. A worker that is gone is noticed through its exit, so a
    /// failed send is only logged.
    pub fn send(&self, msg: &DriverMsg) {
        match encode_line(msg) {
            Ok(line) => {
                if self.tx.send(line).is_err() {
                    tracing::debug!(worker = self.worker, "worker connection already closed");
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot encode a message to a worker"),
        }
    }
}

/// What the rendezvous connections tell the job loop.
#[derive(Debug)]
pub enum Wire {
    /// A worker opened its connection.
    Registered(Registration),
    /// A registered worker asks to join the next round.
    Joined {
        /// The worker.
        worker: u64,
        /// The last round it was part of.
        generation: u64,
        /// Why it asks.
        reason: String,
    },
    /// A registered worker saw the abort of round `generation`.
    AbortSeen {
        /// The worker.
        worker: u64,
        /// The aborted round.
        generation: u64,
    },
    /// A registered worker completed the state sync of round `generation`.
    Synced {
        /// The worker.
        worker: u64,
        /// The round.
        generation: u64,
    },
    /// A registered worker answered a [`DriverMsg::Ping`]: it is alive.
    Pong {
        /// The worker.
        worker: u64,
    },
    /// A registered worker's connection closed; `clean` when it said goodbye first.
    Left {
        /// The worker.
        worker: u64,
        /// Whether it said goodbye.
        clean: bool,
    },
}

/// Accepts rendezvous connections until the job ends. `max_worker` bounds the ids accepted
/// (the world size of a static job).
pub async fn serve(
    listener: TcpListener,
    secret: String,
    max_worker: Option<u64>,
    events: mpsc::Sender<Wire>,
) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let (secret, events) = (secret.clone(), events.clone());
        tokio::spawn(async move {
            if let Err(reason) = handle(stream, &secret, max_worker, events).await {
                tracing::warn!(%peer, %reason, "rendezvous connection refused");
            }
        });
    }
}

async fn read_line(
    r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    buf: &mut Vec<u8>,
) -> std::io::Result<usize> {
    buf.clear();
    r.take(MAX_LINE as u64 + 1).read_until(b'\n', buf).await
}

async fn refuse(mut w: OwnedWriteHalf, reason: String) -> String {
    if let Ok(line) = encode_line(&DriverMsg::Refused {
        reason: reason.clone(),
    }) {
        // The peer may be gone already; the refusal is logged either way.
        let _ = w.write_all(&line).await;
    }
    reason
}

async fn handle(
    stream: TcpStream,
    secret: &str,
    max_worker: Option<u64>,
    events: mpsc::Sender<Wire>,
) -> Result<(), String> {
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let (r, mut w) = stream.into_split();
    let mut reader = BufReader::new(r);
    let mut buf = Vec::new();
    match tokio::time::timeout(FIRST_LINE_TIMEOUT, read_line(&mut reader, &mut buf)).await {
        Ok(Ok(n)) if n > 0 => {}
        Ok(Ok(_)) => return Err("closed before registering".into()),
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err(format!("sent nothing for {FIRST_LINE_TIMEOUT:?}")),
    }
    let msg = match decode_line::<WorkerMsg>(&buf) {
        Ok(m) => m,
        Err(e) => return Err(refuse(w, e.to_string()).await),
    };
    if msg.secret() != secret {
        return Err(refuse(w, "wrong job secret".into()).await);
    }
    let WorkerMsg::Register {
        worker,
        addr,
        host,
        pid,
        ..
    } = msg
    else {
        return Err(refuse(w, "expected a registration".into()).await);
    };
    if let Some(max) = max_worker.filter(|&m| worker >= m) {
        return Err(refuse(w, format!("rank {worker} is outside a world of {max}")).await);
    }
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    // One writer per connection: a stopped worker that reads nothing never blocks the driver.
    tokio::spawn(async move {
        while let Some(line) = rx.recv().await {
            if w.write_all(&line).await.is_err() {
                break;
            }
        }
    });
    let reg = Registration {
        worker,
        addr,
        host,
        pid,
        tx,
    };
    if events.send(Wire::Registered(reg)).await.is_err() {
        return Ok(()); // the job is over
    }
    let mut clean = false;
    loop {
        match read_line(&mut reader, &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let msg = match decode_line::<WorkerMsg>(&buf) {
            Ok(m) if m.secret() == secret => m,
            Ok(_) => {
                tracing::warn!(worker, "message with a wrong secret; connection closed");
                break;
            }
            Err(e) => {
                tracing::warn!(worker, error = %e, "malformed message from worker; connection closed");
                break;
            }
        };
        match msg {
            WorkerMsg::Goodbye { .. } => clean = true,
            WorkerMsg::Join {
                generation, reason, ..
            } => {
                let ev = Wire::Joined {
                    worker,
                    generation,
                    reason,
                };
                if events.send(ev).await.is_err() {
                    return Ok(());
                }
            }
            WorkerMsg::AbortSeen { generation, .. } => {
                if events
                    .send(Wire::AbortSeen { worker, generation })
                    .await
                    .is_err()
                {
                    return Ok(());
                }
            }
            WorkerMsg::Synced { generation, .. } => {
                if events
                    .send(Wire::Synced { worker, generation })
                    .await
                    .is_err()
                {
                    return Ok(());
                }
            }
            WorkerMsg::Pong { .. } => {
                if events.send(Wire::Pong { worker }).await.is_err() {
                    return Ok(());
                }
            }
            WorkerMsg::Register { .. } => {
                tracing::warn!(worker, "second registration on one connection; ignored");
            }
        }
    }
    tracing::debug!(worker, clean, "worker closed its rendezvous connection");
    // The job may be over; then nobody listens.
    let _ = events.send(Wire::Left { worker, clean }).await;
    Ok(())
}
