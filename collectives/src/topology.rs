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

/// Every host's ranks, hosts numbered as in `host_of`, ranks ascending.
fn groups(host_of: &[usize]) -> Vec<Vec<usize>> {
    let hosts = host_of.iter().max().map_or(0, |&h| h + 1);
    (0..hosts)
        .map(|h| (0..host_of.len()).filter(|&r| host_of[r] == h).collect())
        .collect()
}

/// Why the hosts' shape rules the hierarchy out, if it does: it needs several hosts, the same
/// number of ranks on each, and more than one there.
fn shape_refusal(groups: &[Vec<usize>]) -> Option<&'static str> {
    let per_host = groups.first().map_or(0, Vec::len);
    if groups.len() < 2 {
        Some("the world spans one host")
    } else if groups.iter().any(|g| g.len() != per_host) {
        Some("hosts run different numbers of ranks")
    } else if per_host < 2 {
        Some("every host runs one rank")
    } else {
        None
    }
}

/// Whether the hosts' shape allows the hierarchy (see [`Communicator::split_hosts`]).
pub(crate) fn hierarchy_fits(host_of: &[usize]) -> bool {
    shape_refusal(&groups(host_of)).is_none()
}

/// The peers `rank` connects to while the world forms; the others connect on first use.
///
/// Up to `direct_max` ranks (where every call opens with a message to every peer), all of
/// them. Beyond, what the rounds of a call need: the ring's neighbours `rank ± 1`, the
/// openings' partners `rank ± 2^k` (which are also Adasum's and every halving scheme's), and
/// where the hosts' shape allows the hierarchy, every rank of this host and the ranks in this
/// rank's place on the other hosts: about `2 log2 n` peers, not `n - 1`. The relation is
/// symmetric, so both ends of a pair agree on whether it connects now.
pub(crate) fn eager_peers(rank: usize, host_of: &[usize], direct_max: usize) -> Vec<bool> {
    let n = host_of.len();
    if n <= direct_max.max(1) {
        return (0..n).map(|p| p != rank).collect();
    }
    let mut eager = vec![false; n];
    let mut step = 1;
    while step < n {
        eager[(rank + step) % n] = true;
        eager[(rank + n - step) % n] = true;
        step *= 2;
    }
    if hierarchy_fits(host_of) {
        let groups = groups(host_of);
        let mine = &groups[host_of[rank]];
        let place = mine.iter().position(|&r| r == rank).unwrap_or(0);
        for &p in mine {
            eager[p] = true;
        }
        for g in &groups {
            eager[g[place]] = true;
        }
    }
    eager[rank] = false;
    eager
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
        let groups = groups(host_of);
        if groups.len() < 2 {
            return Ok(());
        }
        let why_not = shape_refusal(&groups).or_else(|| {
            (agreed.hierarchical & 3 == 0)
                .then_some("not every host could read its ranks' memory, or a rank disabled it")
        });
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
        // Both are among the pairs connected while the world formed; these are no-ops then.
        self.reach(local_members.iter().copied())?;
        self.reach(cross_members.iter().copied())?;
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
                Some(s) => Some(s.try_clone().map_err(|source| CommError::Io {
                    context: "duplicating a socket for hierarchical allreduce".into(),
                    source,
                })?),
                None if m == self.rank() => None,
                None => {
                    return Err(CommError::Broken {
                        cause: format!("no connection to rank {m} of this rank's host or place"),
                    });
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Host layouts: one address, one rank per host, hosts of 4, and uneven hosts.
    fn layouts(n: usize) -> Vec<Vec<usize>> {
        vec![
            vec![0; n],
            (0..n).collect(),
            (0..n).map(|r| r / 4).collect(),
            (0..n).map(|r| r % 3).collect(),
            (0..n).map(|r| usize::from(r * 3 >= n)).collect(),
        ]
    }

    #[test]
    fn both_ends_of_a_pair_agree_whether_it_connects_now() {
        for n in 1..=70 {
            for host_of in layouts(n) {
                for direct in [1, 8] {
                    let sets: Vec<Vec<bool>> =
                        (0..n).map(|r| eager_peers(r, &host_of, direct)).collect();
                    for (a, set) in sets.iter().enumerate() {
                        assert!(!set[a], "n={n} rank {a} connects to itself");
                        for (b, other) in sets.iter().enumerate() {
                            assert_eq!(set[b], other[a], "n={n} {host_of:?} {a}-{b}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn small_worlds_connect_every_pair() {
        for n in 1..=8 {
            for r in 0..n {
                let eager = eager_peers(r, &vec![0; n], 8);
                assert_eq!(eager.iter().filter(|&&e| e).count(), n - 1);
            }
        }
    }

    #[test]
    fn large_worlds_connect_the_rounds_partners_and_no_more() {
        for n in [9usize, 12, 16, 33, 64, 100, 1024] {
            let rounds = n.next_power_of_two().trailing_zeros() as usize;
            for r in [0, 1, n / 2, n - 1] {
                let eager = eager_peers(r, &(0..n).collect::<Vec<_>>(), 8);
                let mut step = 1;
                while step < n {
                    assert!(
                        eager[(r + step) % n] && eager[(r + n - step) % n],
                        "n={n} r={r}"
                    );
                    step *= 2;
                }
                let count = eager.iter().filter(|&&e| e).count();
                assert!(count <= 2 * rounds, "n={n} r={r}: {count} peers");
            }
        }
    }

    #[test]
    fn hierarchical_worlds_connect_host_and_place_peers() {
        // 5 hosts of 4 ranks, interleaved: rank r on host r % 5, place r / 5.
        let host_of: Vec<usize> = (0..20).map(|r| r % 5).collect();
        for r in 0..20 {
            let eager = eager_peers(r, &host_of, 8);
            for p in (0..20).filter(|&p| p != r) {
                if host_of[p] == host_of[r] || p / 5 == r / 5 {
                    assert!(eager[p], "rank {r} misses peer {p}");
                }
            }
        }
        // Uneven hosts rule the hierarchy out: only the rounds' partners (±16 is ∓4 here).
        let host_of: Vec<usize> = (0..20).map(|r| usize::from(r >= 5)).collect();
        let eager = eager_peers(0, &host_of, 8);
        let partners: Vec<usize> = (0..20).filter(|&p| eager[p]).collect();
        assert_eq!(partners, [1, 2, 4, 8, 12, 16, 18, 19]);
    }
}
