//! The fixed-size descriptor that opens every collective on every connection.
//!
//! Each rank sends its descriptor to every peer before any data moves, so every rank sees what
//! every other rank called and a mismatch is reported identically everywhere, naming both sides.
//! Encoding is a pure function over bytes, tested without sockets.

use std::fmt;

use crate::dtype::{DType, ReduceOp};

const MAGIC: u32 = 0x4856_4443; // "HVDC"

/// Encoded size of a [`Descriptor`].
pub const DESCRIPTOR_LEN: usize = 48;

/// Which collective a descriptor announces; the engine's negotiation names ops by the same tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Allreduce (and grouped allreduce, with `row_len` = the number of tensors).
    Allreduce = 1,
    /// Allgather.
    Allgather = 2,
    /// Broadcast.
    Broadcast = 3,
    /// Alltoall.
    Alltoall = 4,
    /// Reducescatter.
    Reducescatter = 5,
    /// Barrier.
    Barrier = 6,
    /// Horovod's `join` by a rank without a running engine: it has no more data. Met by other
    /// calls, it ends them with [`crate::CommError::Joined`] on every rank.
    Join = 7,
}

impl Kind {
    /// The collective a tag names; `None` for an unknown tag.
    pub(crate) fn from_tag(tag: u8) -> Option<Self> {
        Some(match tag {
            1 => Self::Allreduce,
            2 => Self::Allgather,
            3 => Self::Broadcast,
            4 => Self::Alltoall,
            5 => Self::Reducescatter,
            6 => Self::Barrier,
            7 => Self::Join,
            _ => return None,
        })
    }

    /// The collective's name, as used in errors.
    pub fn name(self) -> &'static str {
        match self {
            Self::Allreduce => "allreduce",
            Self::Allgather => "allgather",
            Self::Broadcast => "broadcast",
            Self::Alltoall => "alltoall",
            Self::Reducescatter => "reducescatter",
            Self::Barrier => "barrier",
            Self::Join => "join",
        }
    }

    /// Whether `count` is per rank (allgather rows, alltoall split) rather than agreed by all.
    pub(crate) fn count_is_per_rank(self) -> bool {
        matches!(self, Self::Allgather | Self::Alltoall)
    }
}

/// What one rank announces to one peer at the start of a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    /// The collective.
    pub kind: Kind,
    /// Element type (`None` for a barrier).
    pub dtype: Option<DType>,
    /// Reduction (`None` where the collective does not reduce).
    pub op: Option<ReduceOp>,
    /// The broadcast root (0 elsewhere).
    pub root: u32,
    /// This communicator's call counter.
    pub seq: u64,
    /// Elements: the whole buffer for allreduce, broadcast and reducescatter; the sender's rows
    /// for allgather; the elements the sender sends to this peer for alltoall.
    pub count: u64,
    /// Row length for allgather and alltoall; number of tensors for a grouped allreduce.
    pub row_len: u64,
    /// Bytes of payload that follow this descriptor on the stream.
    pub payload_len: u64,
    /// The sender's own arguments were invalid; it reports the detail, its peers name it.
    pub invalid: bool,
}

impl Descriptor {
    /// The descriptor of call `seq` of `kind` that carries no data: no type, op or payload.
    pub fn bare(kind: Kind, seq: u64) -> Self {
        Self {
            kind,
            dtype: None,
            op: None,
            root: 0,
            seq,
            count: 0,
            row_len: 1,
            payload_len: 0,
            invalid: false,
        }
    }

    /// Serialises the descriptor (little endian).
    pub fn encode(&self) -> [u8; DESCRIPTOR_LEN] {
        let mut b = [0u8; DESCRIPTOR_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.dtype.map_or(0, |d| d as u8);
        b[6] = self.op.map_or(0, |o| o as u8);
        b[7] = u8::from(self.invalid);
        b[8..12].copy_from_slice(&self.root.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.count.to_le_bytes());
        b[32..40].copy_from_slice(&self.row_len.to_le_bytes());
        b[40..48].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Parses a descriptor, naming what is wrong with a malformed one.
    pub fn decode(b: &[u8; DESCRIPTOR_LEN]) -> Result<Self, String> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(format!("bad magic {magic:#010x} (stream out of sync)"));
        }
        let kind =
            Kind::from_tag(b[4]).ok_or_else(|| format!("unknown collective tag {}", b[4]))?;
        let dtype = match b[5] {
            0 => None,
            t => Some(DType::from_tag(t).ok_or_else(|| format!("unknown dtype tag {t}"))?),
        };
        let op = match b[6] {
            0 => None,
            t => Some(ReduceOp::from_tag(t).ok_or_else(|| format!("unknown reduce op tag {t}"))?),
        };
        Ok(Self {
            kind,
            dtype,
            op,
            root: u32_at(8),
            seq: u64_at(16),
            count: u64_at(24),
            row_len: u64_at(32),
            payload_len: u64_at(40),
            invalid: b[7] & 1 != 0,
        })
    }

    /// Whether two ranks' descriptors describe the same collective call.
    pub fn agrees_with(&self, other: &Self) -> bool {
        self.kind == other.kind
            && self.dtype == other.dtype
            && self.op == other.op
            && self.root == other.root
            && self.seq == other.seq
            && self.row_len == other.row_len
            && (self.kind.count_is_per_rank() || self.count == other.count)
    }
}

impl fmt::Display for Descriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dtype = self.dtype.map_or("-", |d| d.name());
        match self.kind {
            Kind::Barrier => f.write_str("barrier"),
            Kind::Join => f.write_str("join"),
            Kind::Allreduce if self.row_len > 1 => write!(
                f,
                "grouped_allreduce({} tensors, {dtype}[{}] in all, {})",
                self.row_len,
                self.count,
                self.op.map_or("-".into(), |o| o.to_string())
            ),
            Kind::Allreduce | Kind::Reducescatter => write!(
                f,
                "{}({dtype}[{}], {})",
                self.kind.name(),
                self.count,
                self.op.map_or("-".into(), |o| o.to_string())
            ),
            Kind::Broadcast => write!(f, "broadcast({dtype}[{}], root {})", self.count, self.root),
            Kind::Allgather | Kind::Alltoall => {
                write!(f, "{}({dtype}, rows of {})", self.kind.name(), self.row_len)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Descriptor {
        Descriptor {
            kind: Kind::Allreduce,
            dtype: Some(DType::BF16),
            op: Some(ReduceOp::Max),
            root: 3,
            seq: 42,
            count: 1 << 40,
            row_len: 1,
            payload_len: 7,
            invalid: false,
        }
    }

    #[test]
    fn round_trips() {
        let d = sample();
        assert_eq!(Descriptor::decode(&d.encode()), Ok(d));
    }

    #[test]
    fn rejects_garbage() {
        let mut b = sample().encode();
        b[0] ^= 1;
        assert!(Descriptor::decode(&b).unwrap_err().contains("bad magic"));
        let mut b = sample().encode();
        b[4] = 99;
        assert!(
            Descriptor::decode(&b)
                .unwrap_err()
                .contains("collective tag 99")
        );
        let mut b = sample().encode();
        b[5] = 99;
        assert!(Descriptor::decode(&b).unwrap_err().contains("dtype tag 99"));
    }

    #[test]
    fn agreement_ignores_per_rank_counts_only_where_allowed() {
        let a = sample();
        let b = Descriptor {
            count: 5,
            payload_len: 0,
            ..a
        };
        assert!(!a.agrees_with(&b));
        let g = Descriptor {
            kind: Kind::Allgather,
            ..a
        };
        assert!(g.agrees_with(&Descriptor { count: 5, ..g }));
        assert!(!g.agrees_with(&Descriptor { row_len: 2, ..g }));
    }

    #[test]
    fn displays_both_sides_readably() {
        assert_eq!(
            sample().to_string(),
            format!("allreduce(bf16[{}], max)", 1u64 << 40)
        );
    }

    fn any_descriptor() -> impl Strategy<Value = Descriptor> {
        (
            1u8..=7,
            0u8..=7,
            0u8..=6,
            any::<(u32, u64, u64, u64, u64, bool)>(),
        )
            .prop_map(
                |(k, t, o, (root, seq, count, row_len, payload_len, invalid))| Descriptor {
                    kind: Kind::from_tag(k).unwrap(),
                    dtype: DType::from_tag(t),
                    op: ReduceOp::from_tag(o),
                    root,
                    seq,
                    count,
                    row_len,
                    payload_len,
                    invalid,
                },
            )
    }

    /// 48 bytes from a peer: random, or with the right magic and small tags so that decoding
    /// gets past the header often.
    fn any_bytes() -> impl Strategy<Value = [u8; DESCRIPTOR_LEN]> {
        (
            proptest::collection::vec(any::<u8>(), DESCRIPTOR_LEN),
            any::<bool>(),
            0u8..9,
            0u8..10,
            0u8..8,
        )
            .prop_map(|(v, framed, k, t, o)| {
                let mut b = [0u8; DESCRIPTOR_LEN];
                b.copy_from_slice(&v);
                if framed {
                    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
                    b[4..7].copy_from_slice(&[k, t, o]);
                }
                b
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// Any 48 bytes decode to a descriptor that encodes back to them (but for the unused
        /// bytes and bits), or to an error naming the bad field and its value.
        #[test]
        fn any_bytes_decode_or_name_the_bad_field(b in any_bytes()) {
            match Descriptor::decode(&b) {
                Ok(d) => {
                    let e = d.encode();
                    prop_assert_eq!(&e[..7], &b[..7]);
                    prop_assert_eq!(e[7], b[7] & 1);
                    prop_assert_eq!(&e[8..12], &b[8..12]);
                    prop_assert_eq!(&e[16..], &b[16..]);
                    prop_assert_eq!(Descriptor::decode(&e), Ok(d));
                    prop_assert!(d.agrees_with(&d));
                    prop_assert!(!d.to_string().is_empty());
                }
                Err(why) if b[0..4] != MAGIC.to_le_bytes() => {
                    prop_assert!(why.starts_with("bad magic 0x"), "{}", why);
                }
                Err(why) => {
                    let named = [(4, "collective tag"), (5, "dtype tag"), (6, "reduce op tag")]
                        .iter()
                        .any(|&(i, what)| why == format!("unknown {what} {}", b[i]));
                    prop_assert!(named, "{}", why);
                }
            }
        }

        /// Every descriptor survives the wire unchanged, and displays without panicking.
        #[test]
        fn every_descriptor_round_trips(d in any_descriptor()) {
            prop_assert_eq!(Descriptor::decode(&d.encode()), Ok(d));
            prop_assert!(!d.to_string().is_empty());
        }
    }
}
