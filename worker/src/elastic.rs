//! Elastic training: state that survives membership changes, and the loop that drives them.
//!
//! ```no_run
//! use hvd::elastic::{Object, State};
//! # #[derive(Clone, serde::Serialize, serde::Deserialize)] struct Progress { step: u64 }
//! hvd::init()?;
//! let mut state = State::new(Object(Progress { step: 0 }));
//! hvd::elastic::run(&mut state, |state| {
//!     while state.step < 100 {
//!         // ... a training step with hvd collectives ...
//!         state.step += 1;
//!         state.commit()?;
//!     }
//!     Ok(())
//! })?;
//! # Ok::<(), hvd::Error>(())
//! ```
//!
//! [`run`] synchronizes the state from the worker holding the newest commit before calling
//! the training function. When a collective fails (a peer died or hung), every survivor
//! restores its last commit, joins the driver's next round, runs the reset callbacks,
//! synchronizes and calls the function again (Horovod's order). When the driver announces a host change,
//! [`State::commit`] or [`State::check_host_updates`] raises it on every rank at the same
//! step; the ranks keep their current values (nothing is rolled back) and move to the new
//! round the same way. Workers that join late always receive a sync.

use std::ops::{Deref, DerefMut};

use hvd_collectives::Element;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{Error, Result, Topology};

/// State that [`run`] can copy from one rank to all others.
pub trait Syncable: Clone {
    /// Replaces this value on every rank with `root`'s.
    ///
    /// # Errors
    /// A collective error, or [`Error::State`] when the value can't be encoded.
    fn broadcast_from(&mut self, root: usize) -> Result<()>;
}

/// Any serde value, synchronized as JSON. Dereferences to the value.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Object<T>(pub T);

impl<T> Deref for Object<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for Object<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// Broadcasts a byte string of any length from `root`.
fn broadcast_bytes(bytes: &mut Vec<u8>, root: usize) -> Result<()> {
    let mut len = [i64::try_from(bytes.len()).map_err(|e| Error::State(e.to_string()))?];
    crate::broadcast(&mut len, root)?;
    let len = usize::try_from(len[0]).map_err(|e| Error::State(e.to_string()))?;
    bytes.resize(len, 0);
    crate::broadcast(bytes, root)
}

impl<T: Serialize + DeserializeOwned + Clone> Syncable for Object<T> {
    fn broadcast_from(&mut self, root: usize) -> Result<()> {
        let mut bytes = if crate::rank()? == root {
            serde_json::to_vec(&self.0).map_err(|e| Error::State(e.to_string()))?
        } else {
            Vec::new()
        };
        broadcast_bytes(&mut bytes, root)?;
        self.0 = serde_json::from_slice(&bytes).map_err(|e| Error::State(e.to_string()))?;
        Ok(())
    }
}

/// Numeric buffers (model parameters, optimizer moments) synchronized in place, with no
/// serialization. Dereferences to the buffers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tensors<E>(pub Vec<Vec<E>>);

impl<E> Deref for Tensors<E> {
    type Target = Vec<Vec<E>>;
    fn deref(&self) -> &Vec<Vec<E>> {
        &self.0
    }
}

impl<E> DerefMut for Tensors<E> {
    fn deref_mut(&mut self) -> &mut Vec<Vec<E>> {
        &mut self.0
    }
}

impl<E: Element> Syncable for Tensors<E> {
    fn broadcast_from(&mut self, root: usize) -> Result<()> {
        // Shapes first: a new worker may not know them yet.
        let mut shape: Vec<i64> = self.0.iter().map(|t| t.len() as i64).collect();
        let mut n = [shape.len() as i64];
        crate::broadcast(&mut n, root)?;
        shape.resize(
            usize::try_from(n[0]).map_err(|e| Error::State(e.to_string()))?,
            0,
        );
        crate::broadcast(&mut shape, root)?;
        self.0.resize_with(shape.len(), Vec::new);
        for (t, &len) in self.0.iter_mut().zip(&shape) {
            let len = usize::try_from(len).map_err(|e| Error::State(e.to_string()))?;
            t.resize(len, bytemuck::Zeroable::zeroed());
            crate::broadcast(t, root)?;
        }
        Ok(())
    }
}

impl<A: Syncable, B: Syncable> Syncable for (A, B) {
    fn broadcast_from(&mut self, root: usize) -> Result<()> {
        self.0.broadcast_from(root)?;
        self.1.broadcast_from(root)
    }
}

/// What one member brings to a sync: how many commits its saved state carries, and whether it
/// has never been synchronized (a worker new to the job, whose state is only its own start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    /// Commits its saved state carries.
    pub commits: u64,
    /// Never synchronized: its state counts for nothing and it always receives.
    pub fresh: bool,
}

/// Who sends the newest committed state in a sync, and who must receive it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncPlan {
    /// The rank whose state everyone ends with.
    pub root: usize,
    /// The commits that state carries: every rank's count after the sync.
    pub commits: u64,
    /// The ranks that lack it, in rank order; empty when every rank already holds it.
    pub receivers: Vec<usize>,
}

/// Decides a sync from every member's holding, in rank order. The source is the lowest rank
/// among the synchronized members with the most commits (the lowest rank of all when every
/// member is new, as at a job's start). A member receives when it is new or has fewer
/// commits: members at the same count hold the same state, because every member of a round
/// starts from one source and applies the same collective steps.
pub fn sync_plan(members: &[Holding]) -> SyncPlan {
    let known = members.iter().any(|m| !m.fresh);
    let counts = |m: &Holding| {
        if known && m.fresh {
            None
        } else {
            Some(m.commits)
        }
    };
    let most = members.iter().filter_map(counts).max().unwrap_or(0);
    let root = members
        .iter()
        .position(|m| counts(m) == Some(most))
        .unwrap_or(0);
    let receivers = members
        .iter()
        .enumerate()
        .filter(|&(r, m)| r != root && (m.fresh || m.commits < most))
        .map(|(r, _)| r)
        .collect();
    SyncPlan {
        root,
        commits: most,
        receivers,
    }
}

type ResetCallback = Box<dyn FnMut(&Topology) + Send>;

/// Training state with a last commit to fall back to. Dereferences to the current value.
pub struct State<S: Syncable> {
    value: S,
    saved: S,
    /// How many commits the saved value carries; the rank with the most is the sync source.
    commits: u64,
    /// The newest host update this worker has acted on.
    handled_update: u64,
    /// Whether this worker's value has never been synchronized: it always receives.
    fresh: bool,
    callbacks: Vec<ResetCallback>,
}

impl<S: Syncable + std::fmt::Debug> std::fmt::Debug for State<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("value", &self.value)
            .field("commits", &self.commits)
            .field("handled_update", &self.handled_update)
            .finish_non_exhaustive()
    }
}

impl<S: Syncable> Deref for State<S> {
    type Target = S;
    fn deref(&self) -> &S {
        &self.value
    }
}

impl<S: Syncable> DerefMut for State<S> {
    fn deref_mut(&mut self) -> &mut S {
        &mut self.value
    }
}

/// State of any serde value.
pub type ObjectState<T> = State<Object<T>>;
/// State of numeric buffers.
pub type TensorState<E> = State<Tensors<E>>;

impl<S: Syncable> State<S> {
    /// State starting at `value`, which also counts as its first commit.
    pub fn new(value: S) -> Self {
        Self {
            saved: value.clone(),
            value,
            commits: 0,
            handled_update: 0,
            fresh: true,
            callbacks: Vec::new(),
        }
    }

    /// The value as of the last commit.
    pub fn committed(&self) -> &S {
        &self.saved
    }

    /// Saves the current value as the one to return to after a failure, then checks for
    /// host updates.
    ///
    /// # Errors
    /// [`Error::HostsUpdated`] (handled by [`run`]) or a collective error.
    pub fn commit(&mut self) -> Result<()> {
        self.save();
        crate::client::count_step();
        self.check_host_updates()
    }

    fn save(&mut self) {
        self.saved = self.value.clone();
        self.commits += 1;
    }

    /// Returns the current value to the last commit.
    pub fn restore(&mut self) {
        self.value = self.saved.clone();
    }

    /// Raises [`Error::HostsUpdated`] on every rank at once when the driver announced a host
    /// change to any of them. A small collective (a max-allreduce of the newest update id), so
    /// every rank must call it at the same point.
    ///
    /// # Errors
    /// [`Error::HostsUpdated`] or a collective error.
    pub fn check_host_updates(&mut self) -> Result<()> {
        let newest = steps::newest_update()?;
        if newest > self.handled_update {
            self.handled_update = newest;
            return Err(Error::HostsUpdated { update_id: newest });
        }
        Ok(())
    }

    /// Makes every rank hold the newest committed state. The lowest rank among those with the
    /// most commits (that have been synchronized before) is the source; it is broadcast only
    /// when some rank lacks it (a new worker, or a survivor behind), so after a failure that
    /// left every survivor at the same commit nothing moves. In an elastic job the worker then
    /// tells the driver it holds the state: a worker whose host was drained stays in the job
    /// until a worker that stays has said so.
    ///
    /// # Errors
    /// A collective error.
    pub fn sync(&mut self) -> Result<()> {
        let plan = steps::sync_plan(self.commits, self.fresh)?;
        if !plan.receivers.is_empty() {
            self.value.broadcast_from(plan.root)?;
            self.saved = self.value.clone();
        }
        self.commits = plan.commits;
        self.fresh = false;
        // Announcements this round already accounts for need no further round.
        self.handled_update = self.handled_update.max(crate::updates_through());
        crate::report_synced();
        Ok(())
    }

    /// Adds a function called on every rank that lived through a membership change, in the
    /// new round before the state is synchronized, with the new topology (to rescale a
    /// learning rate, say). As in Horovod, a worker's first pass runs none: a new worker
    /// sets what depends on the world when it builds its state.
    pub fn register_reset_callbacks(&mut self, f: impl FnMut(&Topology) + Send + 'static) {
        self.callbacks.push(Box::new(f));
    }
}

/// Runs `f` elastically: sync, call, and on a peer failure or host change, move every rank
/// to the driver's next round and call `f` again. See the module docs.
///
/// # Errors
/// Whatever `f` returns that is not recoverable; [`Error::Removed`] when the driver has no
/// place for this worker any more (the worker should exit 0); rendezvous failures.
pub fn run<S: Syncable, R>(
    state: &mut State<S>,
    mut f: impl FnMut(&mut State<S>) -> Result<R>,
) -> Result<R> {
    // As in Horovod: after a change the callbacks run first, then the sync; a worker's first
    // pass (a new worker's too) only syncs.
    let mut reset = false;
    loop {
        let result = reset_callbacks(state, reset)
            .and_then(|()| state.sync())
            .and_then(|()| f(state));
        let reason = match result {
            Ok(r) => return Ok(r),
            Err(Error::HostsUpdated { update_id }) => {
                // Every rank raised it at the same step: keep the current values.
                state.save();
                format!("hosts updated (update {update_id})")
            }
            Err(e) if e.is_recoverable() => {
                tracing::warn!(error = %e, "collective failed; restoring the last commit");
                state.restore();
                e.to_string()
            }
            Err(e) => return Err(e),
        };
        crate::rejoin(&reason)?;
        reset = true;
    }
}

/// Runs `state`'s reset callbacks with the new round's topology when `reset` (this worker
/// lived through a membership change), then rebuilds the process sets in a round past the
/// job's first (a collective: every member takes part, new workers too; after the callbacks,
/// so that their collectives pair with what a new worker runs before its state, as in
/// Horovod).
fn reset_callbacks<S: Syncable>(state: &mut State<S>, reset: bool) -> Result<()> {
    if reset {
        let topology = crate::topology()?;
        for cb in &mut state.callbacks {
            cb(&topology);
        }
    }
    if reset || crate::generation() > 1 {
        crate::process_set::restore()?;
    }
    Ok(())
}

/// The steps of [`run`], for bindings whose state lives elsewhere (the Python package keeps
/// PyTorch objects, synchronized with its own broadcasts, and runs the same loop over these).
pub mod steps {
    use crate::Result;

    /// Every rank's holding gathered (a small allgather; every rank calls it at the same
    /// point) and the sync decided from them by [`super::sync_plan`].
    ///
    /// # Errors
    /// A collective error.
    pub fn sync_plan(commits: u64, fresh: bool) -> Result<super::SyncPlan> {
        let mine = [commits as i64, i64::from(fresh)];
        let all = crate::allgather(&mine, 2)?;
        let members: Vec<super::Holding> = all
            .chunks_exact(2)
            .map(|m| super::Holding {
                commits: m[0].max(0) as u64,
                fresh: m[1] != 0,
            })
            .collect();
        Ok(super::sync_plan(&members))
    }

    /// Leaves the current communicator and joins the driver's next round, saying why; joins
    /// again while a peer dies as a new round connects.
    ///
    /// # Errors
    /// [`crate::Error::Removed`] when the driver has no place for this worker any more; an
    /// error that no next round mends.
    pub fn rejoin(reason: &str) -> Result<()> {
        crate::rejoin(reason)
    }

    /// The round this worker is in (0 before its first, 1 for the job's first).
    pub fn generation() -> u64 {
        crate::generation()
    }

    /// Tells the driver this worker holds the newest committed state of its round.
    pub fn report_synced() {
        crate::report_synced();
    }

    /// The newest host update the current round accounts for.
    pub fn updates_through() -> u64 {
        crate::updates_through()
    }

    /// The highest host-update id the driver has announced to this worker (0: none).
    pub fn latest_update() -> u64 {
        crate::latest_update()
    }

    /// The newest host update any rank has been told of: a max-allreduce of
    /// [`latest_update`] (every rank calls it at the same point), left out of the allreduce
    /// rates rank 0 reports.
    ///
    /// # Errors
    /// A collective error.
    pub fn newest_update() -> Result<u64> {
        let mut newest = [crate::latest_update() as i64];
        crate::allreduce_uncounted(&mut newest, crate::ReduceOp::Max)?;
        Ok(newest[0].max(0) as u64)
    }

    /// Counts one committed training step for the driver's step rate (`State::commit` counts
    /// its own; a frontend that commits its own way calls this).
    pub fn count_step() {
        crate::client::count_step();
    }

    /// Counts one allreduce of `bytes` for the driver's allreduce rates (hvd's own allreduce
    /// functions count theirs; a frontend that submits to the engine directly calls this).
    pub fn count_allreduce(bytes: usize) {
        crate::client::count_allreduce(bytes);
    }

    /// Rebuilds the process sets of the previous round for the current one.
    ///
    /// # Errors
    /// A collective error.
    pub fn restore_process_sets() -> Result<()> {
        crate::process_set::restore()
    }
}

/// A deterministic partition of an epoch's samples over the current world that survives
/// resizes: after one, the samples of the epoch not yet processed are split anew, so none is
/// repeated and none skipped. Keep it in the synchronized state.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ElasticSampler {
    /// Number of samples in the dataset.
    pub len: usize,
    /// Seed of the per-epoch shuffle.
    pub seed: u64,
    /// The current epoch.
    pub epoch: u64,
    /// Samples of this epoch already processed, by all ranks together.
    pub processed: usize,
}

impl ElasticSampler {
    /// A sampler over `len` samples, shuffled per epoch with `seed`.
    pub fn new(len: usize, seed: u64) -> Self {
        Self {
            len,
            seed,
            epoch: 0,
            processed: 0,
        }
    }

    /// Starts epoch `epoch` from its first sample.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.processed = 0;
    }

    /// The epoch's sample order (a seeded Fisher-Yates shuffle).
    pub fn order(&self) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..self.len).collect();
        let mut s = self.seed ^ self.epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for i in (1..idx.len()).rev() {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let j = ((s >> 33) as usize) % (i + 1);
            idx.swap(i, j);
        }
        idx
    }

    /// The next batch of `rank` in a world of `size`: rank `r` takes the `r`-th of each group
    /// of `size` consecutive unprocessed samples, `batch` groups at a time. The last batch of
    /// an epoch may be short (or empty for some ranks); nothing is padded or repeated.
    pub fn batch(&self, rank: usize, size: usize, batch: usize) -> Vec<usize> {
        let order = self.order();
        let rest = &order[self.processed.min(order.len())..];
        rest.iter()
            .take(batch * size)
            .skip(rank)
            .step_by(size.max(1))
            .copied()
            .collect()
    }

    /// Records that every rank processed its batch of `batch` in a world of `size`.
    pub fn record_batch(&mut self, size: usize, batch: usize) {
        self.processed = (self.processed + batch * size).min(self.len);
    }

    /// Whether the epoch has no sample left.
    pub fn epoch_done(&self) -> bool {
        self.processed >= self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(list: &[(u64, bool)]) -> Vec<Holding> {
        list.iter()
            .map(|&(commits, fresh)| Holding { commits, fresh })
            .collect()
    }

    #[test]
    fn survivors_at_the_newest_commit_receive_nothing() {
        let plan = sync_plan(&held(&[(7, false), (7, false), (7, false)]));
        assert_eq!(
            plan,
            SyncPlan {
                root: 0,
                commits: 7,
                receivers: vec![]
            }
        );
    }

    #[test]
    fn new_members_and_survivors_behind_receive_from_the_lowest_newest() {
        let plan = sync_plan(&held(&[
            (6, false),
            (7, false),
            (0, true),
            (7, false),
            (6, false),
        ]));
        assert_eq!(
            plan,
            SyncPlan {
                root: 1,
                commits: 7,
                receivers: vec![0, 2, 4]
            }
        );
    }

    #[test]
    fn at_a_jobs_start_everyone_receives_rank_zeros_state() {
        let plan = sync_plan(&held(&[(0, true), (0, true), (0, true)]));
        assert_eq!(
            plan,
            SyncPlan {
                root: 0,
                commits: 0,
                receivers: vec![1, 2]
            }
        );
    }

    #[test]
    fn a_new_member_never_sources_even_when_no_one_committed() {
        // Survivors of a failure before the first commit still hold the synchronized start.
        let plan = sync_plan(&held(&[(0, true), (0, false), (0, false)]));
        assert_eq!(
            plan,
            SyncPlan {
                root: 1,
                commits: 0,
                receivers: vec![0]
            }
        );
    }

    #[test]
    fn sampler_neither_repeats_nor_skips_across_resizes() {
        let mut s = ElasticSampler::new(1000, 42);
        s.set_epoch(3);
        let mut seen = Vec::new();
        // Sizes change between batches, as they do across resets.
        let sizes = [
            4usize, 4, 3, 3, 3, 7, 1, 2, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5,
        ];
        let mut i = 0;
        while !s.epoch_done() {
            let size = sizes[i % sizes.len()];
            i += 1;
            for r in 0..size {
                seen.extend(s.batch(r, size, 16));
            }
            s.record_batch(size, 16);
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..1000).collect::<Vec<_>>());
        let mut other = s.clone();
        other.set_epoch(4);
        assert_ne!(s.order(), other.order(), "each epoch has its own order");
        assert_eq!(s.order(), s.clone().order(), "deterministic");
    }

    #[test]
    fn state_commit_and_restore() {
        let mut st = State::new(Object(vec![1u32]));
        st.0.push(2);
        st.save();
        st.0.push(3);
        st.restore();
        assert_eq!(st.0, vec![1, 2]);
        assert_eq!(st.committed().0, vec![1, 2]);
        assert_eq!(st.commits, 1);
    }
}
