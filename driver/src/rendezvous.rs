//! The driver's side of the rendezvous: workers connect, prove they hold the job secret (and
//! learn that the driver does) without sending it, register their listener address, and keep
//! the connection open; every line after the handshake is sealed to that connection. The driver answers rounds with rank tables
//! and pushes host changes down it; a worker notices at once when its driver is gone, and the
//! driver notices at once when a worker's connection drops. The driver also pings every worker
//! on it: a process that stops answering is frozen, although its connection stays open.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use hvd_auth::refusals::{Refusals, Refused, Report, SUMMARY_CHECK, SUMMARY_EVERY};

use hvd_rendezvous::{
    DriverMsg, ListenerAuth, MAX_LINE, ProtocolError, Sealer, WorkerMsg, open_line, refusal_line,
    seal_line,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::metrics::{Metrics, Progress};

const FIRST_LINE_TIMEOUT: Duration = Duration::from_secs(10);

/// A worker that proved it holds the job secret.
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
    /// The round it trains in, when it reconnects after losing its driver.
    pub resume: Option<u64>,
    /// Messages queued here are sealed and written to the worker in order; dropping it
    /// closes the connection.
    pub tx: mpsc::UnboundedSender<DriverMsg>,
}

impl Registration {
    /// Queues `msg` for the worker. A worker that is gone is noticed through its exit, so a
    /// failed send is only logged.
    pub fn send(&self, msg: &DriverMsg) {
        if self.tx.send(msg.clone()).is_err() {
            tracing::debug!(worker = self.worker, "worker connection already closed");
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
    /// A registered worker says its host is going away.
    Notice {
        /// The worker.
        worker: u64,
        /// Who gave the notice.
        source: hvd_rendezvous::NoticeSource,
        /// How long the host has left, as the notice says.
        within: Option<std::time::Duration>,
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
/// (the world size of a static job). A connection that fails the handshake or breaks its
/// session is closed; the job goes on. The first refusal of each address and reason is
/// logged with the peer's address, the rest counted in a line per reason every few seconds.
pub async fn serve(
    listener: TcpListener,
    secret: String,
    max_worker: Option<u64>,
    events: mpsc::Sender<Wire>,
) {
    accept(listener, secret, max_worker, None, events).await;
}

/// [`serve`] for an elastic job, whose rank 0 also reports its training progress: each
/// report goes to `progress` with the reporting worker's id, or is dropped when the job loop
/// is behind (the next one is a few seconds away). Refusals are counted in `metrics`.
pub async fn serve_reporting(
    listener: TcpListener,
    secret: String,
    progress: mpsc::Sender<(u64, Progress)>,
    events: mpsc::Sender<Wire>,
    metrics: Metrics,
) {
    let reporting = Reporting { progress, metrics };
    accept(listener, secret, None, Some(reporting), events).await;
}

/// What an elastic job's rendezvous reports beyond its events.
struct Reporting {
    progress: mpsc::Sender<(u64, Progress)>,
    metrics: Metrics,
}

/// Logs the refusals counted and not logged yet when the server stops.
struct LogRest(Arc<Mutex<Refusals>>);

impl Drop for LogRest {
    fn drop(&mut self) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .log_rest("rendezvous");
    }
}

async fn accept(
    listener: TcpListener,
    secret: String,
    max_worker: Option<u64>,
    reporting: Option<Reporting>,
    events: mpsc::Sender<Wire>,
) {
    let refusals = Arc::new(Mutex::new(Refusals::new(SUMMARY_EVERY)));
    // The counts not logged yet are logged when the server stops (its task is dropped).
    let _rest = LogRest(Arc::clone(&refusals));
    let (progress, metrics) = match reporting {
        Some(r) => (Some(r.progress), Some(r.metrics)),
        None => (None, None),
    };
    let mut summaries = tokio::time::interval(SUMMARY_CHECK);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = summaries.tick() => {
                refusals
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .log_summary("rendezvous", Instant::now());
                continue;
            }
        };
        let Ok((stream, peer)) = accepted else {
            continue;
        };
        // A dual-stack listener sees IPv4 peers as mapped IPv6; log them as people write them.
        let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
        let (secret, events, progress) = (secret.clone(), events.clone(), progress.clone());
        let (refusals, metrics) = (Arc::clone(&refusals), metrics.clone());
        tokio::spawn(async move {
            let sinks = Sinks { events, progress };
            if let Err(r) = handle(stream, peer, &secret, max_worker, sinks).await {
                let mut refusals = refusals.lock().unwrap_or_else(PoisonError::into_inner);
                if refusals.log("rendezvous", peer, r.reason, &r.detail) == Report::Counted {
                    let (reason, detail) = (r.reason, &r.detail);
                    tracing::debug!(%peer, reason, detail, "rendezvous connection refused");
                }
                if let Some(m) = &metrics {
                    m.refused("rendezvous", r.reason);
                }
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

/// Reads one line of the handshake or the registration, which a peer must send promptly.
async fn read_handshake_line(
    r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    buf: &mut Vec<u8>,
    what: &str,
) -> Result<(), Refused> {
    match tokio::time::timeout(FIRST_LINE_TIMEOUT, read_line(r, buf)).await {
        Ok(Ok(n)) if n > 0 => Ok(()),
        Ok(Ok(_)) => Err(Refused::new("silent", format!("closed before {what}"))),
        Ok(Err(e)) => Err(Refused::io(&e)),
        Err(_) => Err(Refused::new(
            "silent",
            format!("sent nothing for {FIRST_LINE_TIMEOUT:?} before {what}"),
        )),
    }
}

/// Refuses a connection that has no session: an unsealed refusal, then the connection closes.
async fn refuse(mut w: OwnedWriteHalf, refused: Refused) -> Refused {
    if let Ok(line) = refusal_line(&refused.detail) {
        // The peer may be gone already; the refusal is logged either way.
        let _ = w.write_all(&line).await;
    }
    refused
}

/// Refuses an authenticated worker (its registration is not acceptable), sealed.
async fn refuse_sealed(mut w: OwnedWriteHalf, sealer: &mut Sealer, refused: Refused) -> Refused {
    let msg = DriverMsg::Refused {
        reason: refused.detail.clone(),
    };
    if let Ok(line) = seal_line(sealer, &msg) {
        let _ = w.write_all(&line).await;
    }
    refused
}

/// Where a connection's messages go: the job loop's events, and rank 0's progress reports
/// where the job takes them.
struct Sinks {
    events: mpsc::Sender<Wire>,
    progress: Option<mpsc::Sender<(u64, Progress)>>,
}

async fn handle(
    stream: TcpStream,
    peer: SocketAddr,
    secret: &str,
    max_worker: Option<u64>,
    sinks: Sinks,
) -> Result<(), Refused> {
    let Sinks { events, progress } = sinks;
    stream.set_nodelay(true).map_err(|e| Refused::io(&e))?;
    let (r, mut w) = stream.into_split();
    let mut reader = BufReader::new(r);
    let mut buf = Vec::new();
    read_handshake_line(&mut reader, &mut buf, "its hello").await?;
    let (listener, challenge) = match ListenerAuth::answer(secret, &buf) {
        Ok(answer) => answer,
        Err(e) => {
            return Err(refuse(w, Refused::new("not_hello", format!("not a hello: {e}"))).await);
        }
    };
    w.write_all(&challenge).await.map_err(|e| Refused::io(&e))?;
    read_handshake_line(&mut reader, &mut buf, "its proof").await?;
    let (mut sealer, mut opener) = match listener.finish(&buf) {
        Ok(session) => session.split(),
        Err(ProtocolError::Auth(_)) => {
            let reason = "wrong job secret: its proof does not match (another job's secret, or \
                          a handshake replayed from another connection)";
            return Err(refuse(w, Refused::new("wrong_secret", reason)).await);
        }
        Err(e) => {
            return Err(refuse(w, Refused::new("not_proof", format!("not a proof: {e}"))).await);
        }
    };
    read_handshake_line(&mut reader, &mut buf, "registering").await?;
    let msg = match open_line::<WorkerMsg>(&mut opener, &buf) {
        Ok(m) => m,
        Err(e) => {
            let refused = Refused::new("bad_registration", e.to_string());
            return Err(refuse_sealed(w, &mut sealer, refused).await);
        }
    };
    let WorkerMsg::Register {
        worker,
        addr,
        host,
        pid,
        resume,
    } = msg
    else {
        let refused = Refused::new("bad_registration", "expected a registration");
        return Err(refuse_sealed(w, &mut sealer, refused).await);
    };
    if let Some(max) = max_worker.filter(|&m| worker >= m) {
        let refused = Refused::new(
            "outside_world",
            format!("rank {worker} is outside a world of {max}"),
        );
        return Err(refuse_sealed(w, &mut sealer, refused).await);
    }
    let (tx, mut rx) = mpsc::unbounded_channel::<DriverMsg>();
    // One writer per connection, which alone seals: a stopped worker that reads nothing never
    // blocks the driver, and tags follow the order of the lines on the wire.
    tokio::spawn(async move {
        while let Some(msg) = rx.recv().await {
            let line = match seal_line(&mut sealer, &msg) {
                Ok(line) => line,
                Err(e) => {
                    tracing::error!(error = %e, "cannot encode a message to a worker");
                    continue;
                }
            };
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
        resume,
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
        let msg = match open_line::<WorkerMsg>(&mut opener, &buf) {
            Ok(m) => m,
            Err(e) => {
                // Tampered, replayed, from another connection, or not a message: nothing
                // more on this connection can be trusted.
                tracing::warn!(worker, %peer, error = %e, "message refused; connection closed");
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
            WorkerMsg::Notice {
                source, within_ms, ..
            } => {
                let ev = Wire::Notice {
                    worker,
                    source,
                    within: within_ms.map(std::time::Duration::from_millis),
                };
                if events.send(ev).await.is_err() {
                    return Ok(());
                }
            }
            WorkerMsg::Progress {
                steps,
                allreduces,
                allreduce_bytes,
                lateness_permille,
                ..
            } => {
                if let Some(p) = &progress {
                    let report = Progress {
                        steps,
                        allreduces,
                        allreduce_bytes,
                        lateness_permille,
                    };
                    let _ = p.try_send((worker, report));
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use hvd_rendezvous::{AuthMsg, DialerAuth, Opener, decode_line, encode_line};

    const SECRET: &str = "job-secret";

    /// A driver's rendezvous on a free port, and what it tells the job.
    async fn driver() -> (SocketAddr, mpsc::Receiver<Wire>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(serve(listener, SECRET.into(), None, tx));
        (addr, rx)
    }

    /// One connection as a worker sees it, every line it wrote recorded.
    struct Client {
        r: BufReader<tokio::net::tcp::OwnedReadHalf>,
        w: OwnedWriteHalf,
        wrote: Vec<Vec<u8>>,
    }

    impl Client {
        async fn connect(addr: SocketAddr) -> Self {
            let (r, w) = TcpStream::connect(addr).await.unwrap().into_split();
            Self {
                r: BufReader::new(r),
                w,
                wrote: Vec::new(),
            }
        }

        async fn write(&mut self, line: &[u8]) {
            self.wrote.push(line.to_vec());
            self.w.write_all(line).await.unwrap();
        }

        /// The next line, or an empty one once the driver closed the connection.
        async fn line(&mut self) -> Vec<u8> {
            let mut buf = Vec::new();
            let read =
                tokio::time::timeout(Duration::from_secs(10), self.r.read_until(b'\n', &mut buf));
            // A reset is as closed as an end of stream.
            let _ = read.await.expect("the driver answers or closes");
            buf
        }

        /// The handshake with `secret`; the sealing halves once both proofs checked out.
        async fn handshake(&mut self, secret: &str) -> Result<(Sealer, Opener), ProtocolError> {
            let (dialer, hello) = DialerAuth::start(secret)?;
            self.write(&hello).await;
            let challenge = self.line().await;
            let (proof, session) = dialer.finish(&challenge)?;
            self.write(&proof).await;
            Ok(session.split())
        }

        /// A genuine worker `worker`: the handshake and a registration.
        async fn register(addr: SocketAddr, worker: u64) -> (Self, Sealer, Opener) {
            let mut c = Self::connect(addr).await;
            let (mut sealer, opener) = c.handshake(SECRET).await.unwrap();
            let reg = WorkerMsg::Register {
                worker,
                addr: format!("127.0.0.1:{}", 5000 + worker),
                host: "127.0.0.1".into(),
                pid: 1,
                resume: None,
            };
            c.write(&seal_line(&mut sealer, &reg).unwrap()).await;
            (c, sealer, opener)
        }
    }

    async fn next(rx: &mut mpsc::Receiver<Wire>) -> Wire {
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("an event")
            .expect("the server runs")
    }

    /// After a refused connection nothing reached the job, and a genuine worker still
    /// registers.
    async fn job_unharmed(addr: SocketAddr, rx: &mut mpsc::Receiver<Wire>, worker: u64) {
        let (_c, _, _) = Client::register(addr, worker).await;
        match next(rx).await {
            Wire::Registered(r) => assert_eq!(r.worker, worker),
            other => panic!("expected worker {worker}'s registration, got {other:?}"),
        }
    }

    fn refusal(line: &[u8]) -> String {
        match decode_line::<AuthMsg>(line) {
            Ok(AuthMsg::Refused { reason }) => reason,
            other => panic!("expected a refusal, got {other:?} from {line:?}"),
        }
    }

    #[tokio::test]
    async fn a_wrong_secret_is_refused_either_way_and_the_job_goes_on() {
        let (addr, mut rx) = driver().await;
        // A worker of another job learns that the driver is not its own and says nothing more.
        let mut c = Client::connect(addr).await;
        let e = c.handshake("another-job").await.unwrap_err();
        assert!(matches!(e, ProtocolError::Auth(_)), "{e}");
        // One that sends a proof anyway is refused, and the driver says why.
        let mut c = Client::connect(addr).await;
        let (_, hello) = DialerAuth::start("another-job").unwrap();
        c.write(&hello).await;
        let _challenge = c.line().await;
        c.write(
            &encode_line(&AuthMsg::Proof {
                proof: "ab".repeat(32),
            })
            .unwrap(),
        )
        .await;
        assert!(refusal(&c.line().await).contains("wrong job secret"));
        assert!(c.line().await.is_empty(), "the connection closes");
        // Something that is no hello at all.
        let mut c = Client::connect(addr).await;
        c.write(b"GET / HTTP/1.1\r\n").await;
        assert!(refusal(&c.line().await).contains("not a hello"));
        job_unharmed(addr, &mut rx, 0).await;
    }

    #[tokio::test]
    async fn a_recorded_handshake_replayed_later_is_refused() {
        let (addr, mut rx) = driver().await;
        let (genuine, _, _) = Client::register(addr, 1).await;
        assert!(matches!(next(&mut rx).await, Wire::Registered(_)));
        // Everything the worker sent, replayed on a new connection: its proof was for the
        // driver's old nonce.
        let mut replay = Client::connect(addr).await;
        replay.write(&genuine.wrote[0]).await;
        let _challenge = replay.line().await;
        replay.write(&genuine.wrote[1]).await;
        replay.write(&genuine.wrote[2]).await;
        assert!(refusal(&replay.line().await).contains("wrong job secret"));
        job_unharmed(addr, &mut rx, 2).await;
    }

    #[tokio::test]
    async fn a_tampered_message_closes_its_connection_and_nothing_else() {
        let (addr, mut rx) = driver().await;
        let (mut c, mut sealer, _) = Client::register(addr, 3).await;
        assert!(matches!(next(&mut rx).await, Wire::Registered(_)));
        let join = WorkerMsg::Join {
            worker: 3,
            generation: 1,
            reason: "hosts updated".into(),
        };
        let line = seal_line(&mut sealer, &join).unwrap();
        let tampered = String::from_utf8(line)
            .unwrap()
            .replace("\"generation\":1", "\"generation\":7");
        c.write(tampered.as_bytes()).await;
        match next(&mut rx).await {
            Wire::Left { worker, clean } => assert_eq!((worker, clean), (3, false)),
            other => panic!("a tampered join must not reach the job: {other:?}"),
        }
        job_unharmed(addr, &mut rx, 4).await;
    }

    #[tokio::test]
    async fn a_message_sealed_for_another_connection_is_refused() {
        let (addr, mut rx) = driver().await;
        let (mut a, _, _) = Client::register(addr, 5).await;
        assert!(matches!(next(&mut rx).await, Wire::Registered(_)));
        let (b, mut b_sealer, _) = Client::register(addr, 6).await;
        assert!(matches!(next(&mut rx).await, Wire::Registered(_)));
        // B's next line, numbered as A's next one would be (both registered), sent on A's
        // connection: the same job, another session key.
        let goodbye = seal_line(&mut b_sealer, &WorkerMsg::Goodbye { worker: 5 }).unwrap();
        a.write(&goodbye).await;
        match next(&mut rx).await {
            Wire::Left { worker, clean } => assert_eq!((worker, clean), (5, false)),
            other => panic!("a foreign line must not reach the job: {other:?}"),
        }
        drop(b);
        assert!(matches!(
            next(&mut rx).await,
            Wire::Left {
                worker: 6,
                clean: false
            }
        ));
    }

    #[tokio::test]
    async fn the_driver_seals_what_it_sends_and_reads_what_workers_seal() {
        let (addr, mut rx) = driver().await;
        let (mut c, mut sealer, mut opener) = Client::register(addr, 7).await;
        let Wire::Registered(reg) = next(&mut rx).await else {
            panic!("no registration");
        };
        reg.send(&DriverMsg::Ping);
        let line = c.line().await;
        assert!(line.contains(&b'\t'), "sealed: {line:?}");
        assert_eq!(
            open_line::<DriverMsg>(&mut opener, &line).unwrap(),
            DriverMsg::Ping
        );
        c.write(&seal_line(&mut sealer, &WorkerMsg::Pong { worker: 7 }).unwrap())
            .await;
        assert!(matches!(next(&mut rx).await, Wire::Pong { worker: 7 }));
        // The same line again is a replay.
        let again = c.wrote.last().unwrap().clone();
        c.write(&again).await;
        assert!(matches!(
            next(&mut rx).await,
            Wire::Left {
                worker: 7,
                clean: false
            }
        ));
    }
}
