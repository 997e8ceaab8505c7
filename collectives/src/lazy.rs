//! Pairs of ranks that connect on first use.
//!
//! Beyond [`crate::CommConfig::direct_open_max`] ranks a world connects, while it forms, only
//! the pairs its rounds need (`topology::eager_peers`: about `2 log2 n` a rank), so that a
//! rebuild grows with the world and not with its square. A call that needs another pair
//! (alltoall, a large allgather over TCP) connects it then, once, through a listener of the
//! communicator's own: its connections never meet another communicator's (a process set's,
//! the next round's) on the rank's listener, where they would be refused as strangers.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};

use crate::comm::Communicator;
use crate::error::{CommError, Result};

/// This rank's listener for pairs connected on first use, and where every rank's is.
#[derive(Debug)]
pub(crate) struct Later {
    listener: TcpListener,
    addrs: Vec<SocketAddr>,
}

/// Binds this rank's listener for later pairs on the address of `listener` (any port), its
/// queue long enough for a dial from every rank of a world of `size`, so that a call every
/// rank makes at once (alltoall) does not overflow it. Returns it with its port.
pub(crate) fn bind_beside(listener: &TcpListener, size: usize) -> Result<(TcpListener, u16)> {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage, bind, listen, socket,
    };
    let io = |context: &'static str| {
        move |source: std::io::Error| CommError::Io {
            context: context.into(),
            source,
        }
    };
    let addr = SocketAddr::new(
        listener
            .local_addr()
            .map_err(io("the listener's address"))?
            .ip(),
        0,
    );
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let bound = (|| -> std::io::Result<TcpListener> {
        let fd: OwnedFd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
        bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
        let queue = i32::try_from(size.clamp(128, 4096)).unwrap_or(4096);
        listen(&fd, Backlog::new(queue).unwrap_or(Backlog::MAXCONN))?;
        Ok(TcpListener::from(fd))
    })()
    .map_err(io("binding the listener for later pairs"))?;
    let port = bound
        .local_addr()
        .map_err(io("the later pairs' listener's address"))?
        .port();
    Ok((bound, port))
}

impl Later {
    /// This rank's listener `own` and every rank's: rank `j` listens on the address in
    /// `peers[j]`, at the port in `ports[j]` (two bytes, as every rank gathered them).
    pub(crate) fn new(own: TcpListener, peers: &[SocketAddr], ports: &[Vec<u8>]) -> Result<Self> {
        let addrs = peers
            .iter()
            .zip(ports)
            .enumerate()
            .map(|(j, (p, port))| match port[..] {
                [a, b] => Ok(SocketAddr::new(p.ip(), u16::from_le_bytes([a, b]))),
                _ => Err(CommError::Protocol {
                    rank: j,
                    detail: format!("its listener's port in {} bytes", port.len()),
                }),
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            listener: own,
            addrs,
        })
    }
}

impl Communicator {
    /// Connects this rank to those of `peers` it has no connection to yet. Every rank this
    /// names must name this rank at the same point of its calls (the pair connects only when
    /// both ends are there), as the calls that need every peer do; a peer that is not there
    /// within the arrival timeout fails the call, as it would the call's own wait for it.
    pub(crate) fn reach(&mut self, peers: impl IntoIterator<Item = usize>) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let mut wanted = vec![false; n];
        let mut any = false;
        for p in peers {
            if p < n && p != r && self.readers[p].is_none() {
                wanted[p] = true;
                any = true;
            }
        }
        if !any {
            return Ok(());
        }
        let Some(later) = self.later.as_ref() else {
            let p = wanted.iter().position(|&w| w).unwrap_or(0);
            return Err(self.fail(CommError::Broken {
                cause: format!("no connection to rank {p}, and none can be made later"),
            }));
        };
        let watch: Vec<(usize, &TcpStream)> = self
            .readers
            .iter()
            .enumerate()
            .filter_map(|(p, s)| s.as_ref().map(|s| (p, s)))
            .collect();
        let made = crate::connect::pairs(
            &self.cfg,
            &later.listener,
            &later.addrs,
            &wanted,
            &watch,
            self.cfg.arrival_timeout,
            &self.shared,
        );
        let made = match made {
            Ok(made) => made,
            Err(e) => return Err(self.fail(e)),
        };
        for (p, s) in made.into_iter().enumerate() {
            let Some(s) = s else { continue };
            if self.readers[p].is_some() {
                continue;
            }
            let w = match s.try_clone() {
                Ok(w) => w,
                Err(source) => {
                    let e = CommError::Io {
                        context: "duplicating a socket".into(),
                        source,
                    };
                    return Err(self.fail(e));
                }
            };
            tracing::debug!(rank = r, peer = p, "connected on first use");
            self.readers[p] = Some(s);
            self.writers[p] = Some(w);
        }
        Ok(())
    }
}
