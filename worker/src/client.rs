//! The worker's connection to the driver: registration, the rank table, and a watchdog that
//! ends the worker when its driver is gone, so no worker outlives its launcher.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use hvd_rendezvous::{DriverMsg, MAX_LINE, WorkerMsg, decode_line, encode_line};

use crate::error::{Error, Result};
use crate::launch::Launch;

/// The rank table the driver sent.
#[derive(Debug, Clone)]
pub(crate) struct World {
    pub generation: u64,
    pub peers: Vec<SocketAddr>,
    pub hosts: Vec<String>,
}

/// An open rendezvous connection.
#[derive(Debug)]
pub(crate) struct Client {
    stream: TcpStream,
    leaving: Arc<AtomicBool>,
    secret: String,
    rank: usize,
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
    /// Registers with the driver and waits for the rank table.
    pub(crate) fn register(l: &Launch, advertised: &str) -> Result<(Self, World)> {
        let addr = l.rendezvous.clone();
        let fail = |detail: String| Error::Rendezvous {
            addr: addr.clone(),
            detail,
        };
        let target = l
            .rendezvous
            .to_socket_addrs()
            .map_err(|e| fail(e.to_string()))?
            .next()
            .ok_or_else(|| fail("address resolves to nothing".into()))?;
        let mut stream = TcpStream::connect_timeout(&target, l.start_timeout)
            .map_err(|e| fail(e.to_string()))?;
        stream.set_nodelay(true).map_err(|e| fail(e.to_string()))?;
        let hello = WorkerMsg::Register {
            secret: l.secret.clone(),
            rank: l.rank,
            addr: advertised.to_string(),
            host: l.hostname.clone(),
            pid: std::process::id(),
        };
        let line = encode_line(&hello).map_err(|e| fail(e.to_string()))?;
        stream.write_all(&line).map_err(|e| fail(e.to_string()))?;
        stream
            .set_read_timeout(Some(l.start_timeout))
            .map_err(|e| fail(e.to_string()))?;
        let started = Instant::now();
        let mut reader = BufReader::new(stream.try_clone().map_err(|e| fail(e.to_string()))?);
        let mut buf = Vec::new();
        let n = read_line(&mut reader, &mut buf)
            .map_err(|e| fail(format!("no rank table after {:?}: {e}", started.elapsed())))?;
        if n == 0 {
            return Err(fail(
                "the driver closed the connection before sending the rank table".into(),
            ));
        }
        let world = match decode_line::<DriverMsg>(&buf).map_err(|e| fail(e.to_string()))? {
            DriverMsg::World {
                generation,
                peers,
                hosts,
            } => {
                if peers.len() != l.size || hosts.len() != l.size {
                    return Err(fail(format!(
                        "rank table has {} entries for a world of {}",
                        peers.len(),
                        l.size
                    )));
                }
                let peers = peers
                    .iter()
                    .map(|p| {
                        p.to_socket_addrs()
                            .ok()
                            .and_then(|mut a| a.next())
                            .ok_or_else(|| fail(format!("peer address '{p}' does not resolve")))
                    })
                    .collect::<Result<Vec<_>>>()?;
                World {
                    generation,
                    peers,
                    hosts,
                }
            }
            DriverMsg::Refused { reason } => return Err(fail(format!("refused: {reason}"))),
        };
        stream
            .set_read_timeout(None)
            .map_err(|e| fail(e.to_string()))?;
        let leaving = Arc::new(AtomicBool::new(false));
        spawn_watchdog(reader, Arc::clone(&leaving), l.rank);
        Ok((
            Self {
                stream,
                leaving,
                secret: l.secret.clone(),
                rank: l.rank,
            },
            world,
        ))
    }

    /// Tells the driver this worker is leaving cleanly and closes the connection.
    pub(crate) fn goodbye(mut self) {
        self.leaving.store(true, Ordering::SeqCst);
        let msg = WorkerMsg::Goodbye {
            secret: self.secret.clone(),
            rank: self.rank,
        };
        if let Ok(line) = encode_line(&msg) {
            // The driver may already be gone at exit; nothing is lost then.
            let _ = self.stream.write_all(&line);
        }
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

fn read_line(r: &mut BufReader<TcpStream>, buf: &mut Vec<u8>) -> std::io::Result<usize> {
    buf.clear();
    let n = Read::take(&mut *r, MAX_LINE as u64 + 1).read_until(b'\n', buf)?;
    Ok(n)
}

/// Watches the driver connection. If it closes while this worker has not said goodbye, the
/// driver is gone (killed, or the job is over) and this worker exits: a worker must never be
/// left behind by its launcher.
fn spawn_watchdog(mut reader: BufReader<TcpStream>, leaving: Arc<AtomicBool>, rank: usize) {
    let spawned = thread::Builder::new()
        .name("hvd-driver-watch".into())
        .spawn(move || {
            let mut buf = Vec::new();
            loop {
                match read_line(&mut reader, &mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => match decode_line::<DriverMsg>(&buf) {
                        Ok(msg) => tracing::debug!(?msg, "message from driver"),
                        Err(e) => tracing::warn!(error = %e, "unreadable message from driver"),
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
                        "hvd: rank {rank} lost its connection to the driver (horovodrun); exiting"
                    );
                    std::process::exit(1);
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "could not start the driver watchdog");
    }
}
