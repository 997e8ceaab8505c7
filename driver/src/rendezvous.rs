//! The driver's side of the rendezvous: workers connect, present the job secret and their
//! listener address; when every rank is in, each gets the rank table. Connections stay open so
//! that a worker notices at once when its driver is gone.

use std::time::Duration;

use hvd_rendezvous::{DriverMsg, MAX_LINE, WorkerMsg, decode_line, encode_line};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::job::Event;

const FIRST_LINE_TIMEOUT: Duration = Duration::from_secs(10);

/// A worker that presented the right secret.
#[derive(Debug)]
pub struct Registration {
    /// Its rank.
    pub rank: usize,
    /// Its collective listener.
    pub addr: String,
    /// Its host.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// Where the driver writes to it.
    pub writer: OwnedWriteHalf,
}

/// Accepts rendezvous connections until the job ends.
pub async fn serve(
    listener: TcpListener,
    secret: String,
    size: usize,
    events: mpsc::Sender<Event>,
) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let (secret, events) = (secret.clone(), events.clone());
        tokio::spawn(async move {
            if let Err(reason) = handle(stream, &secret, size, events).await {
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
    size: usize,
    events: mpsc::Sender<Event>,
) -> Result<(), String> {
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let (r, w) = stream.into_split();
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
    let WorkerMsg::Register {
        secret: s,
        rank,
        addr,
        host,
        pid,
    } = msg
    else {
        return Err(refuse(w, "expected a registration".into()).await);
    };
    if s != secret {
        return Err(refuse(w, "wrong job secret".into()).await);
    }
    if rank >= size {
        return Err(refuse(w, format!("rank {rank} is outside a world of {size}")).await);
    }
    let reg = Registration {
        rank,
        addr,
        host,
        pid,
        writer: w,
    };
    if events.send(Event::Registered(reg)).await.is_err() {
        return Ok(()); // the job is over
    }
    // Keep reading: a goodbye or the connection closing tells the driver the worker is leaving.
    let mut clean = false;
    loop {
        match read_line(&mut reader, &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => match decode_line::<WorkerMsg>(&buf) {
                Ok(WorkerMsg::Goodbye { secret: s, .. }) if s == secret => clean = true,
                Ok(other) => tracing::warn!(rank, ?other, "unexpected message from worker"),
                Err(e) => tracing::warn!(rank, error = %e, "malformed message from worker"),
            },
        }
    }
    tracing::debug!(rank, clean, "worker closed its rendezvous connection");
    Ok(())
}

/// Sends the rank table to every registered worker.
pub async fn send_world(regs: &mut [Option<Registration>]) -> Result<(), String> {
    let peers: Vec<String> = regs
        .iter()
        .map(|r| r.as_ref().map_or_else(String::new, |r| r.addr.clone()))
        .collect();
    let hosts: Vec<String> = regs
        .iter()
        .map(|r| r.as_ref().map_or_else(String::new, |r| r.host.clone()))
        .collect();
    let line = encode_line(&DriverMsg::World {
        generation: 0,
        peers,
        hosts,
    })
    .map_err(|e| e.to_string())?;
    for reg in regs.iter_mut().flatten() {
        reg.writer
            .write_all(&line)
            .await
            .map_err(|e| format!("sending the rank table to rank {}: {e}", reg.rank))?;
    }
    Ok(())
}
