//! Who is where: the host groups of a world, and the hierarchy's host and cross-host
//! communicators built over the world's own sockets.

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use crate::comm::Communicator;
use crate::error::{CommError, Result};
use crate::mailbox::{Mailbox, Remote};

/// The two communicators of a hierarchical allreduce, over the world's own sockets: the ranks
/// of this host (reading each other's memory), and the ranks holding this rank's local index
/// on every host (over TCP). They run only inside a world collective, so their messages never
/// interleave with the world's.
#[derive(Debug)]
pub(crate) struct Hierarchy {
    pub(crate) local: Box<Communicator>,
    pub(crate) cross: Box<Communicator>,
    /// Every host's ranks, hosts in the cross communicators' order, ranks ascending.
    pub(crate) groups: Vec<Vec<usize>>,
}

/// Each rank's host group: ranks listening on one address share a host. Groups are numbered
/// in order of their lowest rank.
pub(crate) fn host_groups(peers: &[SocketAddr]) -> Vec<usize> {
    let mut seen: Vec<std::net::IpAddr> = Vec::new();
    peers
        .iter()
        .map(|p| {
            seen.iter().position(|&ip| ip == p.ip()).unwrap_or_else(|| {
                seen.push(p.ip());
                seen.len() - 1
            })
        })
        .collect()
}

impl Communicator {
    /// Sets up hierarchical allreduce when the world spans hosts with the same number (more
    /// than one) of ranks each, every host group could agree on same-host reads, and every rank
    /// wants it. The decision depends only on what every rank agreed, so all make the same one.
    pub(crate) fn split_hosts(
        &mut self,
        host_of: &[usize],
        agreed: &crate::cma::Agreement,
        forced: bool,
    ) -> Result<()> {
        let hosts = host_of.iter().max().map_or(0, |&h| h + 1);
        if hosts < 2 {
            return Ok(());
        }
        let groups: Vec<Vec<usize>> = (0..hosts)
            .map(|h| (0..host_of.len()).filter(|&r| host_of[r] == h).collect())
            .collect();
        let per_host = groups[0].len();
        let why_not = if groups.iter().any(|g| g.len() != per_host) {
            Some("hosts run different numbers of ranks")
        } else if per_host < 2 {
            Some("every host runs one rank")
        } else if agreed.hierarchical & 3 == 0 {
            Some("not every host could read its ranks' memory, or a rank disabled it")
        } else {
            None
        };
        if let Some(reason) = why_not {
            if forced {
                tracing::warn!(
                    reason,
                    "hierarchical allreduce or allgather was asked for but cannot apply"
                );
            }
            return Ok(());
        }
        let me = self.rank();
        let local_members = &groups[host_of[me]];
        let index = local_members.iter().position(|&r| r == me).unwrap_or(0);
        let cross_members: Vec<usize> = groups.iter().map(|g| g[index]).collect();
        let pids = local_members.iter().map(|&r| agreed.pids[r]).collect();
        let mut local = self.sub(local_members, Some(pids))?;
        local.share_mailboxes().map_err(|source| CommError::Io {
            context: "exchanging mailboxes with the ranks of this host".into(),
            source,
        })?;
        let cross = self.sub(&cross_members, None)?;
        self.hier = Some(Hierarchy {
            local: Box::new(local),
            cross: Box::new(cross),
            groups,
        });
        // What every rank wants: one rank's 0 makes allreduce flat everywhere; allgather is
        // hierarchical only where every rank asked for it (Horovod's default is flat).
        self.hier_allreduce = agreed.hierarchical & 1 != 0;
        self.hier_allgather = agreed.hierarchical & 2 != 0;
        // A rank's explicit 0 holds the knob off for autotune too.
        self.hier_refused = (agreed.hierarchical & 1 == 0, agreed.hierarchical & 4 == 0);
        Ok(())
    }

    /// A communicator among `members` (world ranks, ascending position = new rank) over
    /// duplicates of this one's sockets, failing together with it.
    fn sub(&self, members: &[usize], cma: Option<Vec<nix::unistd::Pid>>) -> Result<Self> {
        let mut cfg = self.cfg.clone();
        cfg.rank = members.iter().position(|&r| r == self.rank()).unwrap_or(0);
        cfg.size = members.len();
        cfg.hierarchical = Some(false);
        cfg.hierarchical_allgather = Some(false);
        let mut streams = Vec::with_capacity(members.len());
        for &m in members {
            let s = match self.readers[m].as_ref() {
                Some(s) if m != self.rank() => {
                    Some(s.try_clone().map_err(|source| CommError::Io {
                        context: "duplicating a socket for hierarchical allreduce".into(),
                        source,
                    })?)
                }
                _ => None,
            };
            streams.push(s);
        }
        let dup = |s: &TcpStream| {
            s.try_clone().map_err(|source| CommError::Io {
                context: "duplicating a socket for hierarchical allreduce".into(),
                source,
            })
        };
        let mut extra = Vec::with_capacity(members.len());
        for &m in members {
            extra.push(self.extra[m].iter().map(dup).collect::<Result<Vec<_>>>()?);
        }
        let mut c = Self::from_streams(cfg, streams, Arc::clone(&self.shared));
        c.extra = extra;
        c.cma = cma;
        c.machine_ranks = self.machine_ranks;
        c.cores = self.cores;
        c.background = self.background;
        Ok(c)
    }

    /// Gives this (host) communicator a mailbox and learns its peers': every member sends
    /// where its mailbox is to every other, then reads theirs. Members do this at the same
    /// point of building the world, so nothing else is on these sockets meanwhile.
    fn share_mailboxes(&mut self) -> std::io::Result<()> {
        use std::io::{Read, Write};
        let mailbox = Mailbox::new(self.cfg.small_bytes);
        let own = mailbox.remote();
        for w in self.writers.iter_mut().flatten() {
            w.set_write_timeout(Some(self.cfg.connect_timeout))?;
            w.write_all(&own.encode())?;
        }
        let mut remotes = vec![own; self.size()];
        for (j, r) in self.readers.iter_mut().enumerate() {
            let Some(r) = r else { continue };
            r.set_read_timeout(Some(self.cfg.connect_timeout))?;
            let mut theirs = [0u8; Remote::RECORD];
            r.read_exact(&mut theirs)?;
            remotes[j] = Remote::decode(&theirs);
        }
        self.forget_timeouts();
        let limit = remotes.iter().map(|m| m.capacity).min().unwrap_or(0);
        self.mailbox = mailbox;
        self.mail = Some((remotes, limit));
        Ok(())
    }
}
