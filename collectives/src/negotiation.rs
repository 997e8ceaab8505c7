//! The engine's negotiation: what each rank announces in a cycle, the response cache that
//! shortens it, and which ops every rank may run from what all of them announced.
//!
//! Every cycle each rank announces its pending ops (one small allgather). An op is named by
//! its [`Sig`]: its name, element type, collective ([`Kind`], the same tag the wire's
//! [`crate::Descriptor`] carries), the collective's parameter and its length. An op seen before
//! goes by a 4-byte id from the [`Cache`], which every rank fills and evicts from the same list
//! of agreed ops, so the ids mean the same everywhere. [`agree`] then decides, identically on
//! every rank, which ops run, which fail (ranks that disagree; a collective other than
//! allreduce while ranks have joined), and which this rank joins with zeros.
//!
//! Encoding and agreement are pure functions, tested without sockets.

use std::collections::HashMap;
use std::time::Duration;

use crate::autotune::Setting;
use crate::dtype::{DType, ReduceOp};
use crate::error::CommError;
use crate::wire::Kind;

/// What ranks must agree on for an op to run: its name, element type, collective, that
/// collective's parameter (reduction, root or row length) and its length (0 where ranks may
/// differ: allgather, alltoall).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Sig {
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) kind: Kind,
    pub(crate) param: u64,
    pub(crate) count: u64,
}

impl Sig {
    /// "allreduce 'grad/0' of 1000 f32 (Sum)": how errors name the op.
    pub(crate) fn describe(&self) -> String {
        let param = match self.kind {
            Kind::Allreduce | Kind::Reducescatter => u8::try_from(self.param)
                .ok()
                .and_then(ReduceOp::from_tag)
                .map_or_else(
                    || format!("reduction tag {}", self.param),
                    |op| format!("{op:?}"),
                ),
            Kind::Broadcast => format!("root {}", self.param),
            Kind::Allgather => format!("rows of {}", self.param),
            _ => String::new(),
        };
        format!(
            "{} '{}' of {} {} ({param})",
            self.kind.name(),
            self.name,
            self.count,
            self.dtype.name()
        )
    }
}

/// One pending op in an announcement: in full, or by its id in the response cache.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Entry {
    Full(Sig),
    Cached(u32),
}

/// What one rank announces in a cycle.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Announce {
    pub(crate) stopping: bool,
    /// This rank has joined (see [`crate::Submitter::join`]).
    pub(crate) joined: bool,
    /// Rank 0's clock (milliseconds since its engine started); the stall clock of all ranks.
    pub(crate) clock_ms: u64,
    /// How long this rank's previous negotiation waited for the others, in microseconds: a
    /// rank the others wait for waits least ([`crate::lateness`]).
    pub(crate) waited_us: u32,
    /// Every pending op, in submission order.
    pub(crate) ops: Vec<Entry>,
    /// Rank 0 only: the knobs every rank applies at this cycle, and whether autotune goes on
    /// trying settings after it.
    pub(crate) setting: Option<(Setting, bool)>,
}

impl Announce {
    /// The announcement's bytes (little endian).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(16 + self.ops.len() * 8);
        let tuning = self.setting.is_some_and(|(_, t)| t);
        b.push(
            u8::from(self.stopping)
                | (u8::from(self.joined) << 1)
                | (u8::from(self.setting.is_some()) << 2)
                | (u8::from(tuning) << 3),
        );
        b.extend_from_slice(&self.clock_ms.to_le_bytes());
        b.extend_from_slice(&self.waited_us.to_le_bytes());
        if let Some((s, _)) = self.setting {
            b.extend_from_slice(&(s.fusion_bytes as u64).to_le_bytes());
            b.extend_from_slice(&(s.cycle.as_nanos() as u64).to_le_bytes());
            b.push(
                u8::from(s.cache)
                    | (u8::from(s.hierarchical_allreduce) << 1)
                    | (u8::from(s.hierarchical_allgather) << 2),
            );
        }
        b.extend_from_slice(&(self.ops.len() as u32).to_le_bytes());
        for e in &self.ops {
            match e {
                Entry::Cached(id) => {
                    b.push(1);
                    b.extend_from_slice(&id.to_le_bytes());
                }
                Entry::Full(s) => {
                    b.push(0);
                    b.extend_from_slice(&(s.name.len() as u32).to_le_bytes());
                    b.extend_from_slice(s.name.as_bytes());
                    b.push(s.dtype as u8);
                    b.push(s.kind as u8);
                    b.extend_from_slice(&s.param.to_le_bytes());
                    b.extend_from_slice(&s.count.to_le_bytes());
                }
            }
        }
        b
    }

    /// Decodes one announcement from the front of `b`; returns it and the bytes it used.
    /// `None` for bytes that are not one: cut short, an unknown type or collective, a name
    /// that is not UTF-8.
    pub(crate) fn decode(b: &[u8]) -> Option<(Self, usize)> {
        let mut at = 0usize;
        let mut take = |n: usize| -> Option<&[u8]> {
            let s = b.get(at..at.checked_add(n)?)?;
            at += n;
            Some(s)
        };
        let u64_at = |s: &[u8]| -> Option<u64> { Some(u64::from_le_bytes(s.try_into().ok()?)) };
        let u32_at = |s: &[u8]| -> Option<u32> { Some(u32::from_le_bytes(s.try_into().ok()?)) };
        let flags = take(1)?[0];
        let (stopping, joined) = (flags & 1 != 0, flags & 2 != 0);
        let clock_ms = u64_at(take(8)?)?;
        let waited_us = u32_at(take(4)?)?;
        let setting = if flags & 4 != 0 {
            let fusion_bytes = usize::try_from(u64_at(take(8)?)?).ok()?;
            let cycle = Duration::from_nanos(u64_at(take(8)?)?);
            let knobs = take(1)?[0];
            Some((
                Setting {
                    fusion_bytes,
                    cycle,
                    cache: knobs & 1 != 0,
                    hierarchical_allreduce: knobs & 2 != 0,
                    hierarchical_allgather: knobs & 4 != 0,
                },
                flags & 8 != 0,
            ))
        } else {
            None
        };
        let count = u32_at(take(4)?)? as usize;
        let mut ops = Vec::with_capacity(count.min(1 << 16));
        for _ in 0..count {
            if take(1)?[0] == 1 {
                ops.push(Entry::Cached(u32_at(take(4)?)?));
                continue;
            }
            let len = u32_at(take(4)?)? as usize;
            let name = String::from_utf8(take(len)?.to_vec()).ok()?;
            let dtype = DType::from_tag(take(1)?[0])?;
            let kind = Kind::from_tag(take(1)?[0])?;
            let param = u64_at(take(8)?)?;
            let count = u64_at(take(8)?)?;
            ops.push(Entry::Full(Sig {
                name,
                dtype,
                kind,
                param,
                count,
            }));
        }
        Some((
            Self {
                stopping,
                joined,
                clock_ms,
                waited_us,
                ops,
                setting,
            },
            at,
        ))
    }
}

/// The response cache: ops agreed before, by a short id. Every rank records the same agreed
/// ops in the same order, so the ids mean the same everywhere; when full, the entry agreed
/// least recently gives its id to the new one.
#[derive(Debug, Default)]
pub(crate) struct Cache {
    capacity: usize,
    ids: HashMap<Sig, u32>,
    /// By id: the op and when it was last agreed.
    slots: Vec<(Sig, u64)>,
    clock: u64,
}

impl Cache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.min(u32::MAX as usize),
            ..Self::default()
        }
    }

    /// How many ops it holds at most (0: off).
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// How `sig` is announced: by its id when cached.
    pub(crate) fn entry(&self, sig: Sig) -> Entry {
        match self.ids.get(&sig) {
            Some(&id) => Entry::Cached(id),
            None => Entry::Full(sig),
        }
    }

    pub(crate) fn get(&self, id: u32) -> Option<&Sig> {
        self.slots.get(id as usize).map(|(s, _)| s)
    }

    /// An announcement's ops in full; `Err(id)` names an id the cache does not hold.
    pub(crate) fn resolve(&self, ops: &[Entry]) -> std::result::Result<Vec<Sig>, u32> {
        ops.iter()
            .map(|e| match e {
                Entry::Full(sig) => Ok(sig.clone()),
                Entry::Cached(id) => self.get(*id).cloned().ok_or(*id),
            })
            .collect()
    }

    /// Notes that every rank agreed on `sig`.
    pub(crate) fn record(&mut self, sig: &Sig) {
        if self.capacity == 0 {
            return;
        }
        self.clock += 1;
        if let Some(&id) = self.ids.get(sig) {
            self.slots[id as usize].1 = self.clock;
            return;
        }
        let id = if self.slots.len() < self.capacity {
            self.slots.push((sig.clone(), self.clock));
            self.slots.len() - 1
        } else {
            // Ties cannot happen: every use gets its own tick.
            let (victim, _) = self
                .slots
                .iter()
                .enumerate()
                .min_by_key(|(_, (_, used))| *used)
                .unwrap_or((0, &(sig.clone(), 0)));
            let old = std::mem::replace(&mut self.slots[victim], (sig.clone(), self.clock));
            self.ids.remove(&old.0);
            victim
        };
        self.ids.insert(sig.clone(), id as u32);
    }
}

/// What every rank decided from one cycle's announcements.
#[derive(Debug, Default)]
pub(crate) struct Agreement {
    /// The ops to run now, in the order of the first needed rank; the same on every rank.
    pub(crate) ready: Vec<Sig>,
    /// Ops to run that this rank has joined out of: it takes part with zeros.
    pub(crate) zeros: Vec<Sig>,
    /// Ops pending on every needed rank that fail on every rank, and why.
    pub(crate) failed: Vec<(String, CommError)>,
}

/// The ranks an op must be pending on to run: every rank, or those that have not joined
/// (joined ranks contribute zeros to allreduces). Never empty for a world of one or more.
pub(crate) fn needed(joined: &[bool]) -> Vec<usize> {
    let all = joined.iter().all(|&j| j);
    (0..joined.len()).filter(|&r| all || !joined[r]).collect()
}

/// Decides a cycle from every rank's pending ops (`lists`, by rank, in full), identically on
/// every rank: an op pending on every `needed` rank runs when every rank that has it agrees
/// on it, and fails on every rank (naming both sides) when one disagrees; while some ranks
/// have joined, only allreduces run. `me` is this rank.
pub(crate) fn agree(lists: &[Vec<Sig>], needed: &[usize], me: usize) -> Agreement {
    let n = lists.len();
    let sets: Vec<HashMap<&str, &Sig>> = lists
        .iter()
        .map(|l| l.iter().map(|s| (s.name.as_str(), s)).collect())
        .collect();
    let mut out = Agreement::default();
    let Some(&lead) = needed.first() else {
        return out;
    };
    for sig in &lists[lead] {
        let name = sig.name.as_str();
        if !needed.iter().all(|&r| sets[r].contains_key(name)) {
            continue;
        }
        let absent: Vec<usize> = (0..n).filter(|&r| !sets[r].contains_key(name)).collect();
        if let Some(r) = (0..n).find(|&r| sets[r].get(name).is_some_and(|s| *s != sig)) {
            out.failed.push((
                sig.name.clone(),
                CommError::Mismatch {
                    seq: 0,
                    rank_a: lead,
                    desc_a: sig.describe(),
                    rank_b: r,
                    desc_b: sets[r][name].describe(),
                },
            ));
        } else if !absent.is_empty() && sig.kind != Kind::Allreduce {
            out.failed.push((
                sig.name.clone(),
                CommError::InvalidArgument {
                    op: "engine",
                    detail: format!(
                        "{} cannot run while ranks {absent:?} have joined: only allreduce can",
                        sig.describe()
                    ),
                },
            ));
        } else {
            if absent.contains(&me) {
                out.zeros.push(sig.clone());
            }
            out.ready.push(sig.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sig(name: &str, count: u64) -> Sig {
        Sig {
            name: name.into(),
            dtype: DType::F32,
            kind: Kind::Allreduce,
            param: ReduceOp::Sum as u64,
            count,
        }
    }

    fn names(sigs: &[Sig]) -> Vec<&str> {
        sigs.iter().map(|s| s.name.as_str()).collect()
    }

    #[test]
    fn announcements_round_trip() {
        let a = Announce {
            stopping: true,
            joined: true,
            clock_ms: 42,
            waited_us: 1_500,
            ops: vec![
                Entry::Full(sig("grad/0", 1000)),
                Entry::Cached(7),
                Entry::Full(sig("é", 0)),
            ],
            setting: Some((
                Setting {
                    fusion_bytes: 3 << 20,
                    cycle: Duration::from_micros(2500),
                    cache: false,
                    hierarchical_allreduce: true,
                    hierarchical_allgather: false,
                },
                true,
            )),
        };
        let b = a.encode();
        assert_eq!(Announce::decode(&b), Some((a.clone(), b.len())));
        assert_eq!(Announce::decode(&a.encode()[..5]), None);
        // A cached op costs 5 bytes instead of 44 (its name and shape).
        let cached = Announce {
            ops: vec![Entry::Cached(3)],
            ..Announce::default()
        };
        let full = Announce {
            ops: vec![Entry::Full(sig("layer4.2.conv3.weight", 1000))],
            ..Announce::default()
        };
        assert_eq!(cached.encode().len() + 39, full.encode().len());
    }

    #[test]
    fn an_unknown_type_or_collective_is_no_announcement() {
        let a = Announce {
            ops: vec![Entry::Full(sig("x", 1))],
            ..Announce::default()
        };
        let b = a.encode();
        // flags 1, clock 8, wait 4, count 4, entry tag 1, name length 4, name 1: then dtype,
        // kind.
        let dtype_at = 1 + 8 + 4 + 4 + 1 + 4 + 1;
        for (at, bad) in [(dtype_at, 0xEE), (dtype_at + 1, 0), (dtype_at + 1, 0xEE)] {
            let mut wrong = b.clone();
            wrong[at] = bad;
            assert_eq!(Announce::decode(&wrong), None, "byte {at} = {bad:#x}");
        }
    }

    #[test]
    fn the_cache_evicts_the_op_agreed_least_recently() {
        let mut c = Cache::new(2);
        c.record(&sig("a", 1));
        c.record(&sig("b", 1));
        c.record(&sig("a", 1)); // a is now newer than b
        c.record(&sig("c", 1)); // evicts b, takes its id
        assert_eq!(c.entry(sig("a", 1)), Entry::Cached(0));
        assert_eq!(c.entry(sig("c", 1)), Entry::Cached(1));
        assert_eq!(c.entry(sig("b", 1)), Entry::Full(sig("b", 1)));
        // Another shape of a known name is another op.
        assert_eq!(c.entry(sig("a", 2)), Entry::Full(sig("a", 2)));
        assert_eq!(c.get(1), Some(&sig("c", 1)));
        assert_eq!(c.get(2), None);
        assert_eq!(
            c.resolve(&[Entry::Cached(1), Entry::Full(sig("d", 3))]),
            Ok(vec![sig("c", 1), sig("d", 3)])
        );
        assert_eq!(c.resolve(&[Entry::Cached(0), Entry::Cached(9)]), Err(9));
        let mut off = Cache::new(0);
        off.record(&sig("a", 1));
        assert_eq!(off.entry(sig("a", 1)), Entry::Full(sig("a", 1)));
    }

    #[test]
    fn ops_pending_everywhere_run_in_the_first_ranks_order() {
        let lists = vec![
            vec![sig("b", 1), sig("a", 1), sig("only0", 1)],
            vec![sig("a", 1), sig("b", 1)],
        ];
        let a = agree(&lists, &needed(&[false, false]), 1);
        assert_eq!(names(&a.ready), ["b", "a"]);
        assert!(a.zeros.is_empty() && a.failed.is_empty());
    }

    #[test]
    fn a_disagreement_fails_the_op_on_every_rank_naming_both_sides() {
        let mut other = sig("a", 2);
        other.dtype = DType::F64;
        let lists = vec![vec![sig("a", 1), sig("b", 1)], vec![other, sig("b", 1)]];
        for me in 0..2 {
            let a = agree(&lists, &needed(&[false, false]), me);
            assert_eq!(names(&a.ready), ["b"]);
            let [
                (
                    name,
                    CommError::Mismatch {
                        rank_a,
                        desc_a,
                        rank_b,
                        desc_b,
                        ..
                    },
                ),
            ] = &a.failed[..]
            else {
                panic!("{:?}", a.failed);
            };
            assert_eq!((name.as_str(), *rank_a, *rank_b), ("a", 0, 1));
            assert_eq!(desc_a, "allreduce 'a' of 1 f32 (Sum)");
            assert_eq!(desc_b, "allreduce 'a' of 2 f64 (Sum)");
        }
    }

    #[test]
    fn joined_ranks_add_zeros_to_allreduces_and_refuse_the_rest() {
        let mut gather = sig("g", 0);
        gather.kind = Kind::Allgather;
        gather.param = 4;
        let lists = vec![vec![], vec![sig("a", 3), gather.clone()], vec![sig("a", 3)]];
        let need = needed(&[true, false, false]);
        assert_eq!(need, [1, 2]);
        let joined = agree(&lists, &need, 0);
        assert_eq!(names(&joined.ready), ["a"]);
        assert_eq!(joined.zeros, [sig("a", 3)]);
        let other = agree(&lists, &need, 1);
        assert_eq!(names(&other.ready), ["a"]);
        assert!(other.zeros.is_empty());
        // The allgather is not pending on rank 2 yet: it waits, failing nothing.
        assert!(other.failed.is_empty());
        let lists = vec![vec![], vec![gather.clone()], vec![gather]];
        let refused = agree(&lists, &need, 2);
        assert!(refused.ready.is_empty());
        let [(name, CommError::InvalidArgument { detail, .. })] = &refused.failed[..] else {
            panic!("{:?}", refused.failed);
        };
        assert_eq!(name, "g");
        assert!(detail.contains("ranks [0] have joined"), "{detail}");
        // Once every rank has joined, every rank is needed again.
        assert_eq!(needed(&[true, true]), [0, 1]);
    }

    fn any_kind() -> impl Strategy<Value = Kind> {
        prop_oneof![
            Just(Kind::Allreduce),
            Just(Kind::Allgather),
            Just(Kind::Broadcast),
            Just(Kind::Alltoall),
            Just(Kind::Reducescatter),
        ]
    }

    fn any_dtype() -> impl Strategy<Value = DType> {
        (0u8..=255).prop_filter_map("a dtype tag", DType::from_tag)
    }

    fn any_entry() -> impl Strategy<Value = Entry> {
        prop_oneof![
            any::<u32>().prop_map(Entry::Cached),
            (
                ".{0,24}",
                any_dtype(),
                any_kind(),
                any::<u64>(),
                any::<u64>()
            )
                .prop_map(|(name, dtype, kind, param, count)| Entry::Full(Sig {
                    name,
                    dtype,
                    kind,
                    param,
                    count,
                })),
        ]
    }

    fn any_setting() -> impl Strategy<Value = Option<(Setting, bool)>> {
        proptest::option::of(
            (
                any::<u64>(),
                any::<u64>(),
                any::<[bool; 3]>(),
                any::<bool>(),
            )
                .prop_map(|(fusion, nanos, [cache, hier_ar, hier_ag], tuning)| {
                    (
                        Setting {
                            fusion_bytes: usize::try_from(fusion).unwrap_or(usize::MAX),
                            cycle: Duration::from_nanos(nanos),
                            cache,
                            hierarchical_allreduce: hier_ar,
                            hierarchical_allgather: hier_ag,
                        },
                        tuning,
                    )
                }),
        )
    }

    fn any_announce() -> impl Strategy<Value = Announce> {
        (
            any::<bool>(),
            any::<bool>(),
            (any::<u64>(), any::<u32>()),
            proptest::collection::vec(any_entry(), 0..12),
            any_setting(),
        )
            .prop_map(
                |(stopping, joined, (clock_ms, waited_us), ops, setting)| Announce {
                    stopping,
                    joined,
                    clock_ms,
                    waited_us,
                    ops,
                    setting,
                },
            )
    }

    proptest! {
        #[test]
        fn every_announcement_round_trips_and_any_prefix_is_refused(a in any_announce()) {
            let b = a.encode();
            prop_assert_eq!(Announce::decode(&b), Some((a.clone(), b.len())));
            for cut in 0..b.len() {
                prop_assert_eq!(Announce::decode(&b[..cut]), None);
            }
            // Announcements are gathered back to back: each decodes from the front.
            let mut two = b.clone();
            two.extend_from_slice(&b);
            prop_assert_eq!(Announce::decode(&two), Some((a, b.len())));
        }

        #[test]
        fn any_bytes_decode_without_a_panic(b in proptest::collection::vec(any::<u8>(), 0..96)) {
            if let Some((a, used)) = Announce::decode(&b) {
                prop_assert!(used <= b.len());
                prop_assert_eq!(Announce::decode(&a.encode()).map(|(d, _)| d), Some(a));
            }
        }

        #[test]
        fn a_changed_byte_decodes_to_an_announcement_or_to_none(
            a in any_announce(), at in any::<prop::sample::Index>(), byte in any::<u8>()
        ) {
            let mut b = a.encode();
            let i = at.index(b.len());
            b[i] = byte;
            if let Some((d, used)) = Announce::decode(&b) {
                prop_assert!(used <= b.len());
                prop_assert_eq!(Announce::decode(&d.encode()).map(|(e, _)| e), Some(d));
            }
        }

        #[test]
        fn every_rank_decides_the_same_ready_list_and_failures(
            lists in proptest::collection::vec(
                proptest::collection::vec((0u8..6, 1u64..3), 0..6), 1..5),
            joined in proptest::collection::vec(any::<bool>(), 4),
        ) {
            // Ops named by a small alphabet, so ranks share some; lengths may disagree.
            let lists: Vec<Vec<Sig>> = lists
                .iter()
                .map(|l| {
                    let mut seen = std::collections::HashSet::new();
                    l.iter()
                        .filter(|(n, _)| seen.insert(*n))
                        .map(|(n, c)| sig(&format!("op{n}"), *c))
                        .collect()
                })
                .collect();
            let need = needed(&joined[..lists.len()]);
            let first = agree(&lists, &need, 0);
            for me in 1..lists.len() {
                let other = agree(&lists, &need, me);
                prop_assert_eq!(names(&first.ready), names(&other.ready));
                let failed = |a: &Agreement| a.failed.iter().map(|(n, e)| format!("{n}: {e}")).collect::<Vec<_>>();
                prop_assert_eq!(failed(&first), failed(&other));
            }
            for s in &first.ready {
                prop_assert!(need.iter().all(|&r| lists[r].contains(s)));
            }
        }
    }
}
