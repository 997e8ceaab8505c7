//! The worker's connection to the driver: registration, the rank table, and a watchdog that
//! ends the worker when its driver is gone, so no worker outlives its launcher.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use hvd_collectives::AbortHandle;
use hvd_rendezvous::{
    DialerAuth, DriverMsg, MAX_LINE, Opener, Placement, ProtocolError, Sealer, WorkerMsg,
    open_line, seal_line,
};

use crate::error::{Error, Result};
use crate::launch::Launch;

/// A completed round, as the driver sent it.
#[derive(Debug, Clone)]
pub(crate) struct World {
    pub generation: u64,
    pub placement: Placement,
    pub peers: Vec<SocketAddr>,
    pub hosts: Vec<String>,
    pub updates_through: u64,
}

/// The answer to a registration or a join.
#[derive(Debug)]
pub(crate) enum Round {
    /// This worker's place in the new round.
    World(World),
    /// This worker has no place in the job any more.
    Removed(String),
}

/// This process's training progress since it started: rank 0 reports it to the driver with
/// each answer to a ping ([`WorkerMsg::Progress`]), which makes the job's step and allreduce
/// rates of it.
#[derive(Debug)]
pub(crate) struct Progress {
    steps: AtomicU64,
    allreduces: AtomicU64,
    allreduce_bytes: AtomicU64,
}

/// The progress of this process.
static PROGRESS: Progress = Progress::new();

/// The running engine's status, while there is one: its lateness by rank goes with the report.
static ENGINE_STATUS: Mutex<Option<hvd_collectives::StatusReader>> = Mutex::new(None);

/// The engine whose lateness by rank the progress reports carry from now on (`None`: none).
pub(crate) fn report_engine(status: Option<hvd_collectives::StatusReader>) {
    *ENGINE_STATUS.lock().unwrap_or_else(PoisonError::into_inner) = status;
}

impl Progress {
    const fn new() -> Self {
        Self {
            steps: AtomicU64::new(0),
            allreduces: AtomicU64::new(0),
            allreduce_bytes: AtomicU64::new(0),
        }
    }

    /// The report of `worker`'s counts so far, with the running engine's lateness by rank.
    fn report(&self, worker: u64) -> WorkerMsg {
        let lateness_permille = ENGINE_STATUS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|s| {
                s.lateness()
                    .into_iter()
                    .map(|f| (f * 1000.0).round().clamp(0.0, 1000.0) as u32)
                    .collect()
            })
            .unwrap_or_default();
        WorkerMsg::Progress {
            worker,
            steps: self.steps.load(Ordering::Relaxed),
            allreduces: self.allreduces.load(Ordering::Relaxed),
            allreduce_bytes: self.allreduce_bytes.load(Ordering::Relaxed),
            lateness_permille,
        }
    }
}

/// Counts one training step (a commit of the elastic state).
pub(crate) fn count_step() {
    PROGRESS.steps.fetch_add(1, Ordering::Relaxed);
}

/// Counts one allreduce of `bytes` bytes.
pub(crate) fn count_allreduce(bytes: usize) {
    PROGRESS.allreduces.fetch_add(1, Ordering::Relaxed);
    PROGRESS
        .allreduce_bytes
        .fetch_add(u64::try_from(bytes).unwrap_or(u64::MAX), Ordering::Relaxed);
}

/// What the reader thread has seen of host changes and failed rounds.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    /// The highest `update_id` announced so far (0: none).
    pub latest_update: AtomicU64,
    /// The newest round the driver placed this worker in (0: none yet).
    generation: AtomicU64,
    /// This worker is rank 0 of its newest round: it reports the job's progress.
    rank0: AtomicBool,
    /// A join request the driver has not answered yet: sent again to a driver that took
    /// over, which never saw it.
    pending_join: Mutex<Option<WorkerMsg>>,
    /// The reader reconnects to a driver when its connection drops (a state store's job).
    redial: AtomicBool,
    aborts: Mutex<Aborts>,
    /// Called with a round the driver aborted and why, once its communicators are failed
    /// (elastic jobs: the worker starts joining the next round at once).
    pub on_abort: std::sync::OnceLock<fn(u64, &str)>,
}

/// The communicators of this worker's newest round, and the newest round the driver aborted.
#[derive(Debug, Default)]
struct Aborts {
    /// The newest failed round and why it failed.
    failed: Option<(u64, String)>,
    /// Communicators of the round `.0` (the world's and its process sets').
    watched: Vec<(u64, AbortHandle)>,
}

impl Inbox {
    /// Whether a lost driver connection is redialed rather than the end of this worker.
    fn redialing(&self) -> bool {
        self.redial.load(Ordering::SeqCst)
    }

    /// Registers a communicator of round `generation`, forgetting those of older rounds; one
    /// registered after the driver aborted its round is aborted at once. A handle registered
    /// before its communicator connects (see `Communicator::connect_abortable`) cancels the
    /// connecting too.
    pub fn watch(&self, generation: u64, handle: AbortHandle) {
        let mut a = self.aborts.lock().unwrap_or_else(PoisonError::into_inner);
        a.watched.retain(|(g, _)| *g >= generation);
        match &a.failed {
            Some((g, reason)) if *g == generation => handle.abort(reason.clone()),
            _ => {}
        }
        a.watched.push((generation, handle));
    }

    /// The driver says round `generation` failed: every collective of it, blocked or later,
    /// fails with `reason`, and the worker joins the next round.
    fn abort(&self, generation: u64, reason: &str) {
        let mut a = self.aborts.lock().unwrap_or_else(PoisonError::into_inner);
        if a.failed.as_ref().is_some_and(|(g, _)| *g >= generation) {
            return;
        }
        a.failed = Some((generation, reason.to_string()));
        for (_, h) in a.watched.iter().filter(|(g, _)| *g == generation) {
            h.abort(reason);
        }
    }
}

/// An open rendezvous connection.
#[derive(Debug)]
pub(crate) struct Client {
    /// Written by this side and by the reader thread (which answers aborts), one sealed line
    /// at a time.
    writer: Arc<Mutex<Writer>>,
    leaving: Arc<AtomicBool>,
    rounds: mpsc::Receiver<DriverMsg>,
    pub inbox: Arc<Inbox>,
    worker: u64,
    addr: String,
    round_timeout: Duration,
}

/// Binds this worker's collective listener where the launcher said.
pub(crate) fn bind_listener(l: &Launch) -> Result<(TcpListener, String)> {
    let err = |detail: String| Error::Env {
        var: hvd_rendezvous::ENV_BIND_ADDR,
        detail,
    };
    let ip: IpAddr = if let Some(iface) = &l.interface {
        interface_ip(iface).map_err(|detail| Error::Env {
            var: hvd_rendezvous::ENV_NETWORK_INTERFACE,
            detail,
        })?
    } else if let Some(addr) = &l.bind_addr {
        resolve(addr, 0)
            .map_err(|e| err(format!("'{addr}': {e}")))?
            .ip()
    } else {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    };
    let listener = TcpListener::bind((ip, 0)).map_err(|e| err(format!("bind {ip}: {e}")))?;
    let port = listener
        .local_addr()
        .map_err(|e| err(e.to_string()))?
        .port();
    // Peers must reach us: an unspecified address is advertised by the launcher's host name.
    let advertised = if ip.is_unspecified() {
        format!("{}:{port}", l.hostname)
    } else {
        SocketAddr::new(ip, port).to_string()
    };
    Ok((listener, advertised))
}

fn resolve(host: &str, port: u16) -> std::io::Result<SocketAddr> {
    let mut addrs = (host, port).to_socket_addrs()?;
    addrs
        .next()
        .ok_or_else(|| std::io::Error::other("resolves to no address"))
}

fn interface_ip(name: &str) -> std::result::Result<IpAddr, String> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| format!("listing interfaces: {e}"))?;
    for a in addrs.filter(|a| a.interface_name == name) {
        if let Some(v4) = a.address.as_ref().and_then(|s| s.as_sockaddr_in()) {
            return Ok(IpAddr::V4(v4.ip()));
        }
    }
    Err(format!(
        "interface '{name}' has no IPv4 address (or does not exist)"
    ))
}

impl Client {
    /// Registers with the driver and waits for the first round.
    pub(crate) fn register(l: &Launch, advertised: &str) -> Result<(Self, Round)> {
        let fail = |detail: String| Error::Rendezvous {
            addr: l.rendezvous.clone(),
            detail,
        };
        let (reader, writer, opener) = connect(l, advertised, None).map_err(fail)?;
        let writer = Arc::new(Mutex::new(writer));
        let leaving = Arc::new(AtomicBool::new(false));
        let inbox = Arc::new(Inbox::default());
        let (tx, rounds) = mpsc::channel();
        spawn_reader(
            reader,
            Reader {
                opener,
                leaving: Arc::clone(&leaving),
                inbox: Arc::clone(&inbox),
                rounds: tx,
                answer: Arc::clone(&writer),
                worker: l.worker,
                redial: l.driver_grace.map(|grace| Redial {
                    launch: l.clone(),
                    advertised: advertised.to_string(),
                    grace,
                }),
            },
        );
        if l.elastic {
            let w = Arc::clone(&writer);
            crate::notice::watch_sigterm(l.worker, l.launcher_pid, l.notice_grace, move |msg| {
                send(&w, msg).is_ok()
            });
            if let Some(cloud) = l.preemption_watch {
                let w = Arc::clone(&writer);
                crate::preemption::watch(
                    cloud,
                    &l.metadata_endpoint,
                    l.preemption_poll,
                    (l.worker, &l.hostname),
                    move |msg| send(&w, msg).is_ok(),
                );
            }
        }
        let mut client = Self {
            writer,
            leaving,
            rounds,
            inbox,
            worker: l.worker,
            addr: l.rendezvous.clone(),
            round_timeout: if l.elastic {
                l.elastic_timeout + l.start_timeout
            } else {
                l.start_timeout
            },
        };
        let round = client.wait_round()?;
        Ok((client, round))
    }

    /// Asks the driver for a place in the next round and waits for the answer.
    pub(crate) fn join(&mut self, generation: u64, reason: &str) -> Result<Round> {
        let msg = WorkerMsg::Join {
            worker: self.worker,
            generation,
            reason: reason.to_string(),
        };
        *self
            .inbox
            .pending_join
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(msg.clone());
        if let Err(e) = send(&self.writer, &msg) {
            // With a grace, the reader reconnects and sends the join again.
            if self.inbox.redialing() {
                tracing::debug!(error = %e, "the join waits for a driver to reconnect to");
            } else {
                return Err(self.fail(format!("asking to join: {e}")));
            }
        }
        self.wait_round()
    }

    fn fail(&self, detail: String) -> Error {
        Error::Rendezvous {
            addr: self.addr.clone(),
            detail,
        }
    }

    fn wait_round(&mut self) -> Result<Round> {
        let started = Instant::now();
        let msg = match self.rounds.recv_timeout(self.round_timeout) {
            Ok(m) => m,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                return Err(self.fail(format!(
                    "no rank table after {:.1}s",
                    started.elapsed().as_secs_f64()
                )));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(self.fail(
                    "the driver closed the connection before sending the rank table".into(),
                ));
            }
        };
        match msg {
            DriverMsg::World {
                generation,
                placement,
                peers,
                hosts,
                updates_through,
            } => {
                let p = placement;
                if peers.len() != p.size
                    || hosts.len() != p.size
                    || p.rank >= p.size
                    || p.local_rank >= p.local_size
                    || p.cross_rank >= p.cross_size
                {
                    return Err(self.fail(format!(
                        "inconsistent rank table: {p:?} with {} peers and {} hosts",
                        peers.len(),
                        hosts.len()
                    )));
                }
                let peers = peers
                    .iter()
                    .map(|a| {
                        a.to_socket_addrs()
                            .ok()
                            .and_then(|mut it| it.next())
                            .ok_or_else(|| {
                                self.fail(format!("peer address '{a}' does not resolve"))
                            })
                    })
                    .collect::<Result<Vec<_>>>()?;
                self.inbox
                    .generation
                    .fetch_max(generation, Ordering::SeqCst);
                self.inbox
                    .rank0
                    .store(placement.rank == 0, Ordering::SeqCst);
                *self
                    .inbox
                    .pending_join
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = None;
                Ok(Round::World(World {
                    generation,
                    placement,
                    peers,
                    hosts,
                    updates_through,
                }))
            }
            DriverMsg::Removed { reason } => Ok(Round::Removed(reason)),
            DriverMsg::Refused { reason } => Err(self.fail(format!("refused: {reason}"))),
            DriverMsg::HostsUpdated(_) | DriverMsg::Abort { .. } | DriverMsg::Ping => {
                Err(self.fail("unexpected message while waiting for a round".into()))
            }
        }
    }

    /// Tells the driver this worker completed the state sync of round `generation`, so it
    /// holds the newest committed state. A driver that is gone is noticed by the reader.
    pub(crate) fn synced(&self, generation: u64) {
        let msg = WorkerMsg::Synced {
            worker: self.worker,
            generation,
        };
        if let Err(e) = send(&self.writer, &msg) {
            tracing::debug!(error = %e, "could not report the sync to the driver");
        }
    }

    /// Tells the driver this worker is leaving cleanly and closes the connection.
    pub(crate) fn goodbye(self) {
        self.leaving.store(true, Ordering::SeqCst);
        let msg = WorkerMsg::Goodbye {
            worker: self.worker,
        };
        // The driver may already be gone at exit; nothing is lost then.
        let _ = send(&self.writer, &msg);
        let w = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = w.stream.shutdown(Shutdown::Both);
    }
}

/// The driver connection's writing side: whoever holds it seals and writes one whole line,
/// so the tags follow the order of the lines on the wire.
#[derive(Debug)]
struct Writer {
    stream: TcpStream,
    sealer: Sealer,
}

/// Seals `msg` and writes it to the driver.
fn send(writer: &Mutex<Writer>, msg: &WorkerMsg) -> std::io::Result<()> {
    let mut w = writer.lock().unwrap_or_else(PoisonError::into_inner);
    let line = seal_line(&mut w.sealer, msg).map_err(std::io::Error::other)?;
    w.stream.write_all(&line)
}

/// Proves to the driver that this worker holds the job secret, and checks that the driver
/// does, without either sending it; returns the session's halves.
fn handshake(
    stream: &mut TcpStream,
    reader: &mut BufReader<TcpStream>,
    secret: &str,
    timeout: Duration,
) -> std::result::Result<(Sealer, Opener), String> {
    let (dialer, hello) = DialerAuth::start(secret).map_err(|e| e.to_string())?;
    stream.write_all(&hello).map_err(|e| e.to_string())?;
    // The read timeout belongs to the socket, which the reader shares.
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    match read_line(reader, &mut buf) {
        Ok(0) => return Err("the driver closed the connection during the handshake".into()),
        Ok(_) => {}
        Err(e) => return Err(format!("no answer to the handshake: {e}")),
    }
    let (proof, session) = dialer.finish(&buf).map_err(|e| match e {
        ProtocolError::Auth(_) => format!(
            "the driver's proof of the job secret does not match: it holds another job's \
             secret ({})",
            hvd_rendezvous::ENV_SECRET
        ),
        e => e.to_string(),
    })?;
    stream.write_all(&proof).map_err(|e| e.to_string())?;
    stream.set_read_timeout(None).map_err(|e| e.to_string())?;
    Ok(session.split())
}

/// What the reader thread needs besides the connection it reads.
struct Reader {
    /// Checks the driver's lines, in order.
    opener: Opener,
    leaving: Arc<AtomicBool>,
    inbox: Arc<Inbox>,
    rounds: mpsc::Sender<DriverMsg>,
    /// The connection's writing side, to answer aborts and pings.
    answer: Arc<Mutex<Writer>>,
    worker: u64,
    /// With a state store: how to find a driver again when this one is gone.
    redial: Option<Redial>,
}

/// What a worker needs to reconnect to the driver that takes over.
struct Redial {
    launch: Launch,
    advertised: String,
    /// How long it trains on without a driver before it exits.
    grace: Duration,
}

/// Opens a rendezvous connection: connects, proves the job secret both ways and registers
/// (`resume`: the round this worker trains in, when it reconnects after losing its driver).
fn connect(
    l: &Launch,
    advertised: &str,
    resume: Option<u64>,
) -> std::result::Result<(BufReader<TcpStream>, Writer, Opener), String> {
    let target = l
        .rendezvous
        .to_socket_addrs()
        .map_err(|e| e.to_string())?
        .next()
        .ok_or_else(|| "address resolves to nothing".to_string())?;
    let mut stream =
        TcpStream::connect_timeout(&target, l.start_timeout).map_err(|e| e.to_string())?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let (sealer, opener) = handshake(&mut stream, &mut reader, &l.secret, l.start_timeout)?;
    let writer = Mutex::new(Writer { stream, sealer });
    let hello = WorkerMsg::Register {
        worker: l.worker,
        addr: advertised.to_string(),
        host: l.hostname.clone(),
        pid: std::process::id(),
        resume,
    };
    send(&writer, &hello).map_err(|e| format!("registering: {e}"))?;
    Ok((
        reader,
        writer.into_inner().unwrap_or_else(PoisonError::into_inner),
        opener,
    ))
}

/// Reconnects to whichever driver serves the rendezvous address, backing off (`backon`:
/// exponential from 100 ms to 300 ms, with up to as much again of jitter, so the workers of a
/// large job do not knock on a successor all at once) until `r.grace` has passed since `lost`;
/// `None` then.
fn redial(
    r: &Redial,
    inbox: &Inbox,
    lost: Instant,
) -> Option<(BufReader<TcpStream>, Writer, Opener)> {
    use backon::BackoffBuilder;
    let mut pauses = backon::ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_millis(300))
        .with_jitter()
        .without_max_times()
        .build();
    let mut last_error = String::new();
    while lost.elapsed() < r.grace {
        let generation = inbox.generation.load(Ordering::SeqCst);
        match connect(&r.launch, &r.advertised, Some(generation)) {
            Ok(c) => return Some(c),
            Err(e) => last_error = e,
        }
        let pause = pauses.next().unwrap_or(Duration::from_millis(300));
        thread::sleep(pause.min(r.grace.saturating_sub(lost.elapsed())));
    }
    tracing::debug!(error = %last_error, "the last try to reach a driver");
    None
}

fn read_line(r: &mut BufReader<TcpStream>, buf: &mut Vec<u8>) -> std::io::Result<usize> {
    buf.clear();
    let n = Read::take(&mut *r, MAX_LINE as u64 + 1).read_until(b'\n', buf)?;
    Ok(n)
}

/// Reads the driver connection: rank tables and removals go to `rounds`, host changes to the
/// inbox; an abort fails the round's communicators and is answered at once, so the driver
/// knows this worker is alive even while a long computation keeps it from its next
/// collective. If the connection closes while this worker has not said goodbye, the driver is
/// gone (killed, or the job is over) and this worker exits: a worker must never be left
/// behind by its launcher.
fn spawn_reader(mut reader: BufReader<TcpStream>, r: Reader) {
    let Reader {
        mut opener,
        leaving,
        inbox,
        rounds,
        answer,
        worker,
        redial: redial_with,
    } = r;
    inbox.redial.store(redial_with.is_some(), Ordering::SeqCst);
    let spawned = thread::Builder::new()
        .name("hvd-driver-watch".into())
        .spawn(move || {
            let mut buf = Vec::new();
            'connection: loop {
                match read_line(&mut reader, &mut buf) {
                    Ok(0) | Err(_) => {
                        if leaving.load(Ordering::SeqCst) {
                            break;
                        }
                        let Some(r) = redial_with.as_ref() else { break };
                        let lost = Instant::now();
                        tracing::warn!(grace = ?r.grace, "lost the driver; training on and reconnecting");
                        let Some((rd, w, o)) = redial(r, &inbox, lost) else {
                            let _ = writeln!(
                                std::io::stderr(),
                                "hvd: worker {worker} found no driver within --driver-grace \
                                 ({:.0}s); exiting",
                                r.grace.as_secs_f64()
                            );
                            std::process::exit(1);
                        };
                        (reader, opener) = (rd, o);
                        *answer.lock().unwrap_or_else(PoisonError::into_inner) = w;
                        tracing::info!(after = ?lost.elapsed(), "reconnected to a driver");
                        let pending = inbox
                            .pending_join
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .clone();
                        if let Some(join) = pending {
                            let _ = send(&answer, &join);
                        }
                        continue 'connection;
                    }
                    Ok(_) => match open_line::<DriverMsg>(&mut opener, &buf) {
                        Ok(DriverMsg::HostsUpdated(u)) => {
                            tracing::debug!(update = ?u, "hosts updated");
                            inbox.latest_update.fetch_max(u.update_id, Ordering::SeqCst);
                        }
                        Ok(DriverMsg::Abort { generation, reason }) => {
                            tracing::warn!(generation, %reason, "the driver aborted the round");
                            // Answered before the abort: the join request the failed
                            // collectives lead to comes after it on this connection.
                            let seen = WorkerMsg::AbortSeen { worker, generation };
                            // A failed write means the driver is gone: the read ends next.
                            let _ = send(&answer, &seen);
                            inbox.abort(generation, &reason);
                            if let Some(on_abort) = inbox.on_abort.get() {
                                on_abort(generation, &reason);
                            }
                        }
                        Ok(DriverMsg::Ping) => {
                            // Answered from this thread, so a long training step never looks
                            // like a frozen process.
                            let _ = send(&answer, &WorkerMsg::Pong { worker });
                            if inbox.rank0.load(Ordering::SeqCst) {
                                let _ = send(&answer, &PROGRESS.report(worker));
                            }
                        }
                        Ok(msg) => {
                            // The receiver is gone only while the process is exiting.
                            let _ = rounds.send(msg);
                        }
                        Err(ProtocolError::Refused(reason)) => {
                            let _ = rounds.send(DriverMsg::Refused { reason });
                        }
                        Err(e) => {
                            // Tampered, replayed or not from this driver: nothing more on
                            // this connection can be trusted.
                            tracing::error!(error = %e, "message from the driver refused");
                            break 'connection;
                        }
                    },
                }
            }
            if !leaving.load(Ordering::SeqCst) {
                // Give a concurrent clean shutdown a moment to mark itself.
                thread::sleep(Duration::from_millis(50));
                if !leaving.load(Ordering::SeqCst) {
                    // stderr may be a pipe to the dead driver: a failed write must not stop
                    // the exit (eprintln! would panic this thread and leave the worker behind).
                    let _ = writeln!(
                        std::io::stderr(),
                        "hvd: worker {worker} lost its connection to the driver (horovodrun); exiting"
                    );
                    std::process::exit(1);
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "could not start the driver connection reader");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvd_collectives::Communicator;

    #[test]
    fn an_aborted_round_fails_its_communicators_and_no_other_round() {
        let inbox = Inbox::default();
        let (old, mut world, set) = (
            Communicator::single(),
            Communicator::single(),
            Communicator::single(),
        );
        inbox.watch(1, old.abort_handle());
        inbox.watch(2, world.abort_handle());
        inbox.watch(2, set.abort_handle());
        // A stale abort for a round this worker already left touches nothing.
        inbox.abort(1, "round 1 lost a member");
        assert!(!world.abort_handle().is_aborted());
        assert!(!old.abort_handle().is_aborted(), "round 1 was forgotten");
        inbox.abort(2, "round 2 lost a member: worker 5 on h was killed");
        let e = world.barrier().expect_err("the round was aborted");
        assert!(e.to_string().contains("worker 5 on h was killed"), "{e}");
        assert!(
            set.abort_handle().is_aborted(),
            "process sets fail with their round"
        );
        // A communicator of the failed round connected after the abort fails at once; the
        // next round's does not.
        let (late, next) = (Communicator::single(), Communicator::single());
        inbox.watch(2, late.abort_handle());
        assert!(late.abort_handle().is_aborted());
        inbox.watch(3, next.abort_handle());
        assert!(!next.abort_handle().is_aborted());
        inbox.abort(2, "again");
        assert!(!next.abort_handle().is_aborted());
    }

    #[test]
    fn progress_reports_count_steps_allreduces_and_bytes() {
        let before = PROGRESS.report(0);
        count_step();
        count_allreduce(4096);
        count_allreduce(8);
        let (
            WorkerMsg::Progress {
                steps: s0,
                allreduces: a0,
                allreduce_bytes: b0,
                ..
            },
            WorkerMsg::Progress {
                worker,
                steps,
                allreduces,
                allreduce_bytes,
                lateness_permille,
            },
        ) = (before, PROGRESS.report(3))
        else {
            panic!("not progress reports");
        };
        // Other tests of this process may count too: at least these.
        assert_eq!(worker, 3);
        assert!(steps > s0 && allreduces >= a0 + 2 && allreduce_bytes >= b0 + 4104);
        assert!(
            lateness_permille.is_empty(),
            "no engine runs here: {lateness_permille:?}"
        );
    }
}
