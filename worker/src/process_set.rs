//! Process sets: collectives among a subset of the ranks.
//!
//! Every rank calls [`add_process_set`] with the same ranks, in the same order of calls; the
//! members connect a mesh of their own. In an elastic job the sets survive resets:
//! `hvd::elastic::run` has every rank of the new round rebuild them from rank 0's list,
//! including workers that joined later, dropping ranks the smaller world no longer has.

use hvd_collectives::{CommConfig, Communicator, Element, ReduceOp};

use crate::{Context, Error, Result, context};

/// A subset of the ranks that collectives can run among.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSet {
    /// Its id, the same on every rank.
    pub id: u32,
    /// Its members' global ranks, ascending.
    pub ranks: Vec<usize>,
}

#[derive(Debug)]
struct Entry {
    set: ProcessSet,
    /// This rank's communicator in the set; `None` for a non-member, or between rounds.
    comm: Option<Communicator>,
}

/// The process sets of one process.
#[derive(Debug, Default)]
pub(crate) struct Sets {
    entries: Vec<Entry>,
    next_id: u32,
}

impl Sets {
    /// Drops every set's connections (a new round is starting); the definitions stay.
    pub(crate) fn disconnect(&mut self) {
        for e in &mut self.entries {
            e.comm = None;
        }
    }
}

fn validate(ranks: &[usize], size: usize) -> Result<Vec<usize>> {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.len() != ranks.len() {
        return Err(Error::ProcessSet(format!("ranks {ranks:?} repeat a rank")));
    }
    if sorted.is_empty() {
        return Err(Error::ProcessSet(
            "a process set needs at least one rank".into(),
        ));
    }
    if let Some(bad) = sorted.iter().find(|&&r| r >= size) {
        return Err(Error::ProcessSet(format!(
            "rank {bad} is not in a world of {size}"
        )));
    }
    Ok(sorted)
}

/// Connects this rank's communicator for `set`, between two world barriers so that no other
/// set's connections reach the listener meanwhile.
fn connect(c: &mut Context, set: &ProcessSet) -> Result<Option<Communicator>> {
    let me = c.topology.rank;
    let world = c.comm.as_mut().ok_or(Error::MembershipChanging)?;
    world.barrier()?;
    let comm = match (set.ranks.iter().position(|&r| r == me), c.session.as_ref()) {
        (None, _) => None,
        (Some(_), None) => Some(Communicator::single()),
        (Some(idx), Some(s)) => {
            let l = &s.launch;
            let mut cfg = CommConfig::new(idx, set.ranks.len(), l.secret.clone());
            // Its own generation: a connection meant for another set or round is refused.
            cfg.generation = (s.generation << 20) | u64::from(set.id + 1);
            cfg.progress_timeout = l.progress_timeout;
            cfg.arrival_timeout = l.arrival_timeout;
            cfg.connect_timeout = l.start_timeout;
            cfg.same_host_copy = l.same_host_copy;
            cfg.hierarchical = l.hierarchical;
            cfg.streams = l.streams;
            let peers: Vec<_> = set.ranks.iter().map(|&r| s.peers[r]).collect();
            let comm = Communicator::connect(cfg, &s.listener, &peers)?;
            // The set's collectives fail with the round's when the driver aborts it.
            s.client.inbox.watch(s.generation, comm.abort_handle());
            Some(comm)
        }
    };
    let world = c.comm.as_mut().ok_or(Error::MembershipChanging)?;
    world.barrier()?;
    Ok(comm)
}

/// Creates a process set of `ranks`. Every rank of the job must call it, with the same ranks.
///
/// # Errors
/// [`Error::ProcessSet`] for an empty set, a repeated rank or one outside the world;
/// [`Error::EngineActive`]; a collective error while the members connect.
pub fn add_process_set(ranks: &[usize]) -> Result<ProcessSet> {
    let mut ctx = context();
    let c = ctx.as_mut().ok_or(Error::NotInitialized)?;
    if c.engine_active {
        return Err(Error::EngineActive);
    }
    let ranks = validate(ranks, c.topology.size)?;
    let set = ProcessSet {
        id: c.sets.next_id,
        ranks,
    };
    let comm = connect(c, &set)?;
    c.sets.next_id += 1;
    c.sets.entries.push(Entry {
        set: set.clone(),
        comm,
    });
    Ok(set)
}

/// Removes a process set on this rank; every rank should remove it too.
///
/// # Errors
/// [`Error::ProcessSet`] when no such set exists.
pub fn remove_process_set(set: &ProcessSet) -> Result<()> {
    let mut ctx = context();
    let c = ctx.as_mut().ok_or(Error::NotInitialized)?;
    let before = c.sets.entries.len();
    c.sets.entries.retain(|e| e.set.id != set.id);
    if c.sets.entries.len() == before {
        return Err(Error::ProcessSet(format!("no process set {}", set.id)));
    }
    Ok(())
}

/// The process sets that exist on this rank.
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn process_sets() -> Result<Vec<ProcessSet>> {
    let ctx = context();
    let c = ctx.as_ref().ok_or(Error::NotInitialized)?;
    Ok(c.sets.entries.iter().map(|e| e.set.clone()).collect())
}

/// Runs `f` on this rank's communicator in `set` (ranks there are indices into `set.ranks`).
///
/// # Errors
/// [`Error::NotInProcessSet`] on a non-member; [`Error::ProcessSet`] when the set is gone;
/// [`Error::MembershipChanging`] between rounds; whatever `f` returns.
pub fn with_process_set<R>(
    set: &ProcessSet,
    f: impl FnOnce(&mut Communicator) -> hvd_collectives::Result<R>,
) -> Result<R> {
    let mut ctx = context();
    let c = ctx.as_mut().ok_or(Error::NotInitialized)?;
    let rank = c.topology.rank;
    let e = c
        .sets
        .entries
        .iter_mut()
        .find(|e| e.set.id == set.id)
        .ok_or_else(|| Error::ProcessSet(format!("no process set {}", set.id)))?;
    if !e.set.ranks.contains(&rank) {
        return Err(Error::NotInProcessSet {
            rank,
            set: e.set.id,
            ranks: e.set.ranks.clone(),
        });
    }
    let comm = e.comm.as_mut().ok_or(Error::MembershipChanging)?;
    Ok(f(comm)?)
}

/// [`crate::allreduce`] among the members of `set`.
///
/// # Errors
/// As [`with_process_set`].
pub fn allreduce_on<T: Element>(set: &ProcessSet, buf: &mut [T], op: ReduceOp) -> Result<()> {
    crate::client::count_allreduce(std::mem::size_of_val(buf));
    with_process_set(set, |c| c.allreduce(buf, op))
}

/// Rebuilds the process sets for the current round from rank 0's definitions (a collective:
/// every rank of the round calls it, late joiners included). Ranks past the new size are
/// dropped from each set; a set left empty is gone.
pub(crate) fn restore() -> Result<()> {
    let mut ctx = context();
    let c = ctx.as_mut().ok_or(Error::NotInitialized)?;
    if c.engine_active {
        return Ok(());
    }
    let size = c.topology.size;
    let mine: Vec<(u32, Vec<usize>)> = c
        .sets
        .entries
        .iter()
        .map(|e| (e.set.id, e.set.ranks.clone()))
        .collect();
    let mut bytes = serde_json::to_vec(&(c.sets.next_id, mine))
        .map_err(|e| Error::ProcessSet(e.to_string()))?;
    let world = c.comm.as_mut().ok_or(Error::MembershipChanging)?;
    let mut len = [bytes.len() as i64];
    world.broadcast(&mut len, 0)?;
    bytes.resize(usize::try_from(len[0]).unwrap_or(0), 0);
    world.broadcast(&mut bytes, 0)?;
    let (next_id, defs): (u32, Vec<(u32, Vec<usize>)>) =
        serde_json::from_slice(&bytes).map_err(|e| Error::ProcessSet(e.to_string()))?;
    let mut entries = Vec::with_capacity(defs.len());
    for (id, ranks) in defs {
        let ranks: Vec<usize> = ranks.into_iter().filter(|&r| r < size).collect();
        if ranks.is_empty() {
            tracing::warn!(
                set = id,
                "process set has no rank left in this round; dropped"
            );
            continue;
        }
        let set = ProcessSet { id, ranks };
        let comm = connect(c, &set)?;
        entries.push(Entry { set, comm });
    }
    c.sets = Sets { entries, next_id };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn definitions_are_checked() {
        assert_eq!(validate(&[3, 1], 4).unwrap(), vec![1, 3]);
        assert!(
            validate(&[1, 1], 4)
                .unwrap_err()
                .to_string()
                .contains("repeat")
        );
        assert!(validate(&[], 4).is_err());
        assert!(
            validate(&[4], 4)
                .unwrap_err()
                .to_string()
                .contains("rank 4")
        );
    }
}
