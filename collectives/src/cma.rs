//! Single-copy transfers between ranks of one host: cross-memory attach (`process_vm_readv`).
//!
//! When every rank of a communicator runs on the same machine, a rank reads its peers' buffers
//! straight out of their address space: one kernel copy per byte instead of the two (send and
//! receive) and the TCP stack a loopback socket costs. The sockets still carry the small
//! control messages (descriptors with buffer addresses, barriers) and still detect a dead peer.
//!
//! Whether it is used is agreed by every rank when the mesh is built: same boot id, and every
//! rank could read a known word from every peer. Anything else (another host, a container that
//! forbids the call) falls back to TCP everywhere, so ranks never disagree on the algorithm.
//! The same agreement is made within each host group, for hierarchical allreduce.

use std::io::{self, IoSliceMut};

use crate::error::{CommError, Result};

use nix::sys::uio::{RemoteIoVec, process_vm_readv, process_vm_writev};
use nix::unistd::Pid;

/// A word every process exposes so a peer can check that it may read this process's memory.
static PROBE: u64 = 0x4856_4443_4d41_5052; // "HVDCMAPR"

/// Affinity mask bytes in a record: CPUs 0 to 1023.
const MASK_BYTES: usize = 128;
const RECORD: usize = 4 + 8 + 36 + MAILBOX_LEN + 4 + MASK_BYTES;
/// Where the mailbox record starts in a negotiation record, and its length.
const MAILBOX_AT: usize = 48;
/// Cores this process may run on (asked once: the answer costs system calls and file reads).
pub(crate) fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |c| c.get()))
}

const MAILBOX_LEN: usize = crate::mailbox::Remote::RECORD;
const OFFER_AT: usize = MAILBOX_AT + MAILBOX_LEN;

fn boot_id() -> Option<[u8; 36]> {
    let s = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    s.trim().as_bytes().try_into().ok()
}

/// Reads `out.len()` bytes at `addr` in process `pid`.
pub(crate) fn read_remote(pid: Pid, addr: usize, out: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < out.len() {
        let want = out.len() - done;
        let remote = [RemoteIoVec {
            base: addr + done,
            len: want,
        }];
        let mut local = [IoSliceMut::new(&mut out[done..])];
        let n = process_vm_readv(pid, &mut local, &remote).map_err(io::Error::from)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer memory read returned nothing",
            ));
        }
        done += n;
    }
    Ok(())
}

/// What the ranks agreed about reading each other's memory.
#[derive(Debug, Clone, Default)]
pub(crate) struct Agreement {
    /// Every rank's process id (this rank's own included).
    pub(crate) pids: Vec<Pid>,
    /// Every rank of the world runs on this host and may read every other.
    pub(crate) world: bool,
    /// Every host group agreed on `local`, and which hierarchical collectives every rank
    /// wants: bit 0 allreduce, bit 1 allgather, bit 2 allgather not refused by any rank (0:
    /// none).
    pub(crate) hierarchical: u8,
    /// Every rank's mailbox for small messages (this rank's own included).
    pub(crate) mailboxes: Vec<crate::mailbox::Remote>,
    /// Ranks running on this machine (same boot id), this one included, whatever host group
    /// they belong to: how many share its cores.
    pub(crate) machine_ranks: usize,
    /// The cores this machine's ranks run on, the same number on every one of them (see
    /// [`shared_cores`]).
    pub(crate) cores: usize,
    /// Every rank's [`Offer::rider`], by rank.
    pub(crate) riders: Vec<Vec<u8>>,
}

/// What one rank offers to the cores count: the CPUs it may run on (affinity mask) and how many
/// of them it may use at once (fewer under a CPU quota, or a configured count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CoreOffer {
    /// Bit `i` of byte `i / 8`: CPU `i` is in the rank's affinity mask.
    pub(crate) mask: [u8; MASK_BYTES],
    /// Cores the rank may use at once.
    pub(crate) usable: u32,
}

impl CoreOffer {
    /// This process's offer; `configured` replaces the usable count (`CommConfig::cores`).
    pub(crate) fn own(configured: Option<usize>) -> Self {
        let mut mask = [0u8; MASK_BYTES];
        match nix::sched::sched_getaffinity(Pid::from_raw(0)) {
            Ok(set) => {
                for cpu in 0..(MASK_BYTES * 8).min(nix::sched::CpuSet::count()) {
                    if set.is_set(cpu).unwrap_or(false) {
                        mask[cpu / 8] |= 1 << (cpu % 8);
                    }
                }
            }
            // Unknown: as many CPUs as the process may use, numbered from 0.
            Err(_) => {
                for cpu in 0..cores().min(MASK_BYTES * 8) {
                    mask[cpu / 8] |= 1 << (cpu % 8);
                }
            }
        }
        let usable = configured.unwrap_or_else(cores).max(1);
        Self {
            mask,
            usable: u32::try_from(usable).unwrap_or(u32::MAX),
        }
    }

    fn encode(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&self.usable.to_le_bytes());
        out[4..4 + MASK_BYTES].copy_from_slice(&self.mask);
    }

    fn decode(b: &[u8]) -> Self {
        let mut mask = [0u8; MASK_BYTES];
        mask.copy_from_slice(&b[4..4 + MASK_BYTES]);
        Self {
            mask,
            usable: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }

    fn cpus(&self) -> u32 {
        self.mask.iter().map(|b| b.count_ones()).sum()
    }
}

/// The cores that the ranks of one machine share, from every one's offer, so that all of them
/// agree on it: the union of their affinity masks (ranks pinned to distinct cores count them
/// all), capped by any quota smaller than a rank's own mask (a container's CPU limit binds
/// every process in it). At least 1.
pub(crate) fn shared_cores(offers: &[CoreOffer]) -> usize {
    let mut union = [0u8; MASK_BYTES];
    for o in offers {
        for (u, m) in union.iter_mut().zip(o.mask.iter()) {
            *u |= m;
        }
    }
    let cpus: u32 = union.iter().map(|b| b.count_ones()).sum();
    let quota = offers
        .iter()
        .filter(|o| o.usable < o.cpus())
        .map(|o| o.usable)
        .min()
        .unwrap_or(u32::MAX);
    cpus.min(quota).max(1) as usize
}

/// Writes `data` at `addr` in process `pid`.
pub(crate) fn write_remote(pid: Pid, addr: usize, data: &[u8]) -> io::Result<()> {
    let mut done = 0;
    while done < data.len() {
        let remote = [RemoteIoVec {
            base: addr + done,
            len: data.len() - done,
        }];
        let local = [io::IoSlice::new(&data[done..])];
        let n = process_vm_writev(pid, &local, &remote).map_err(io::Error::from)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "peer memory write took nothing",
            ));
        }
        done += n;
    }
    Ok(())
}

/// What one rank brings to the agreement on same-host transfers.
pub(crate) struct Offer<'a> {
    /// This rank's own setting: one rank that disables same-host reads disables them for
    /// every group it belongs to.
    pub(crate) enabled: bool,
    /// This rank's wish for hierarchical collectives (bit 0 allreduce, bit 1 allgather; bit
    /// 2: allgather not refused); each needs every rank's.
    pub(crate) hierarchical: u8,
    /// This rank's mailbox for small messages.
    pub(crate) mailbox: &'a crate::mailbox::Mailbox,
    /// This rank's part of the machine's core count ([`shared_cores`]).
    pub(crate) cores: CoreOffer,
    /// Bytes of the communicator's own that travel with the record (the same length on every
    /// rank); every rank's come back in [`Agreement::riders`].
    pub(crate) rider: &'a [u8],
}

/// Agrees with every peer which ranks can use cross-memory attach. `host_of[j]` is rank `j`'s
/// host group (ranks listening on one address form one host, so that one machine can play
/// several hosts); `hierarchy_fits` says whether the hosts' shape allows the hierarchy at all.
/// `gather` hands every rank the bytes each rank gave it (by rank): it is called with this
/// rank's record, then with its verdict and wishes, unless neither can matter: the world
/// spans several hosts and the hierarchy does not fit, so same-host reads serve no path.
pub(crate) fn negotiate(
    rank: usize,
    host_of: &[usize],
    hierarchy_fits: bool,
    own: &Offer<'_>,
    mut gather: impl FnMut(&[u8]) -> Result<Vec<Vec<u8>>>,
) -> Result<Agreement> {
    let (enabled, hierarchical, mailbox, offer) =
        (own.enabled, own.hierarchical, own.mailbox, own.cores);
    let n = host_of.len();
    let me = boot_id();
    let mut record = vec![0u8; RECORD + own.rider.len()];
    record[RECORD..].copy_from_slice(own.rider);
    record[..4].copy_from_slice(&std::process::id().to_le_bytes());
    record[4..12].copy_from_slice(&(std::ptr::addr_of!(PROBE) as u64).to_le_bytes());
    if let Some(b) = me {
        record[12..48].copy_from_slice(&b);
    }
    let own = mailbox.remote();
    record[MAILBOX_AT..OFFER_AT].copy_from_slice(&own.encode());
    offer.encode(&mut record[OFFER_AT..RECORD]);
    let records = gather(&record)?;
    if let Some(j) = (0..n).find(|&j| records.get(j).is_none_or(|r| r.len() != record.len())) {
        let detail = "its same-host record has another length".to_string();
        return Err(CommError::Protocol { rank: j, detail });
    }
    let mut offers = vec![offer];
    let mut mailboxes = vec![own; n];
    let mut machine_ranks = 1;
    let mut pids = vec![Pid::from_raw(0); n];
    pids[rank] = Pid::this();
    let one_host = host_of.iter().all(|&h| h == host_of[rank]);
    // No path reads a peer's memory: nothing to probe, no verdicts to gather.
    let settled = !one_host && !hierarchy_fits;
    // Bit 0: this rank can read every peer; bit 1: every peer of its own host group.
    let mut can = [enabled && me.is_some(); 2];
    for (j, theirs) in records.iter().enumerate().filter(|&(j, _)| j != rank) {
        let pid = i32::from_le_bytes([theirs[0], theirs[1], theirs[2], theirs[3]]);
        let mut a = [0u8; 8];
        a.copy_from_slice(&theirs[4..12]);
        pids[j] = Pid::from_raw(pid);
        mailboxes[j] = crate::mailbox::Remote::decode(&theirs[MAILBOX_AT..OFFER_AT]);
        let same_host = host_of[j] == host_of[rank];
        if me.is_some_and(|b| b[..] == theirs[12..48]) {
            machine_ranks += 1;
            offers.push(CoreOffer::decode(&theirs[OFFER_AT..RECORD]));
        }
        if settled || !(can[0] || (same_host && can[1])) {
            continue;
        }
        let readable = me.is_some_and(|b| b[..] == theirs[12..48]) && {
            let mut word = [0u8; 8];
            let addr = usize::try_from(u64::from_le_bytes(a)).unwrap_or(0);
            read_remote(pids[j], addr, &mut word).is_ok() && u64::from_le_bytes(word) == PROBE
        };
        can[0] &= readable;
        if same_host {
            can[1] &= readable;
        }
    }
    let riders = records.iter().map(|r| r[RECORD..].to_vec()).collect();
    if settled {
        return Ok(Agreement {
            pids,
            world: false,
            hierarchical: 0,
            mailboxes,
            machine_ranks,
            cores: shared_cores(&offers),
            riders,
        });
    }
    // Every rank's verdict with the hierarchical paths it wants (bits 2-4) decides the rest.
    // Same-host reads hold within a host group where every member of it can; the hierarchy
    // needs that on every host, and is then what every rank wants.
    let verdict = u8::from(can[0]) | (u8::from(can[1]) << 1) | ((hierarchical & 7) << 2);
    let verdicts = gather(&[verdict])?;
    if let Some(j) = (0..n).find(|&j| verdicts.get(j).is_none_or(|v| v.len() != 1)) {
        let detail = "its same-host verdict has another length".to_string();
        return Err(CommError::Protocol { rank: j, detail });
    }
    let (mut world, mut every_host, mut all) = (one_host, true, 7u8);
    for v in verdicts.iter().map(|v| v[0]) {
        world &= v & 1 == 1;
        every_host &= v & 2 == 2;
        all &= v >> 2;
    }
    Ok(Agreement {
        pids,
        world,
        hierarchical: if every_host { all } else { 0 },
        mailboxes,
        machine_ranks,
        cores: shared_cores(&offers),
        riders,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(cpus: impl IntoIterator<Item = usize>, usable: u32) -> CoreOffer {
        let mut mask = [0u8; MASK_BYTES];
        for c in cpus {
            mask[c / 8] |= 1 << (c % 8);
        }
        CoreOffer { mask, usable }
    }

    #[test]
    fn ranks_sharing_all_cores_count_them_once() {
        let all = vec![offer(0..2, 2); 4];
        assert_eq!(shared_cores(&all), 2);
    }

    #[test]
    fn ranks_pinned_to_distinct_cores_count_every_core() {
        let pinned: Vec<_> = (0..4).map(|c| offer([c * 3], 1)).collect();
        assert_eq!(shared_cores(&pinned), 4);
        let uneven = [offer(0..2, 2), offer([0], 1), offer([5], 1)];
        assert_eq!(shared_cores(&uneven), 3);
    }

    #[test]
    fn a_quota_below_the_mask_binds_every_rank() {
        // A container limited to 2 CPUs on a 64-CPU machine, or a configured count.
        let limited = vec![offer(0..64, 2); 4];
        assert_eq!(shared_cores(&limited), 2);
        let one_configured = [offer(0..64, 64), offer(0..64, 3)];
        assert_eq!(shared_cores(&one_configured), 3);
    }

    #[test]
    fn offers_survive_the_wire_and_never_count_zero() {
        let o = offer([1, 9, 1023], 7);
        let mut b = [0u8; 4 + MASK_BYTES];
        o.encode(&mut b);
        assert_eq!(CoreOffer::decode(&b), o);
        assert_eq!(shared_cores(&[offer([], 0)]), 1);
        let own = CoreOffer::own(None);
        assert!(own.usable >= 1 && own.cpus() >= 1, "{own:?}");
        assert_eq!(CoreOffer::own(Some(5)).usable, 5);
    }
}
